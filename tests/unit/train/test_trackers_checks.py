"""The unit tier of test_trackers.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from support.cli import invoke

from support.trackers import _quiet_wandb


def test_a_tracker_that_is_not_installed_is_exit_2_at_validate_with_the_pip_command(make_recipe, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    result = invoke("validate", make_recipe(logging={"report_to": ["wandb"]}))
    assert result.exit_code == 2
    assert "logging.report_to" in result.output and "pip install wandb (from gpupoor's clone: pip install -e '.[wandb]')" in result.output


def test_unknown_tracker_names_are_schema_errors(make_recipe):
    result = invoke("validate", make_recipe(logging={"report_to": ["comet"]}))
    assert result.exit_code == 2 and "logging.report_to" in result.output and "tensorboard" in result.output


def test_w_and_b_sessions_started_within_one_second_are_all_read_in_order(tmp_path):
    # W&B names a second session that starts in the same second as the first offline-run-TIME-ID-1: the read-back
    # missed it, so a resumed run's own steps were sent again on the next resume.
    from gpupoor.train.trackers import _wandb_logs

    names = ["offline-run-20261125_174459-abc", "offline-run-20261125_174459-abc-1", "offline-run-20261125_174500-abc",
             "offline-run-20261125_174459-abcd", "offline-run-20261125_174459-xyz"]
    for name, run_id in zip(names, ["abc", "abc", "abc", "abcd", "xyz"]):
        (tmp_path / "wandb" / name).mkdir(parents=True)
        (tmp_path / "wandb" / name / f"run-{run_id}.wandb").write_bytes(b"")
    assert [path.parent.name for path in _wandb_logs(tmp_path, "abc")] == names[:3]
