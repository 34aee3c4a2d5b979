"""Trackers (logging.report_to), read back with their own readers: TensorBoard's event files, MLflow's file store
through its client, W&B's offline run. Offline throughout; a resumed run continues the same tracker runs and logs
no step twice; a tracker that fails warns once and the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import invoke, read_metrics

REPORT_ALL = {"report_to": ["tensorboard", "mlflow", "wandb"], "offline": True, "progress": "none"}


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def tensorboard_scalars(run, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def mlflow_history(run, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


def steps_and_losses(run) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def test_every_tracker_gets_every_record_offline_and_a_resume_continues_the_same_runs(make_recipe, tmp_path,
                                                                                       monkeypatch):
    recipe = make_recipe(training={"max_steps": 6, "eval_every_steps": 3}, data={"eval_rows": 6},
                         checkpoint={"every_steps": 2}, logging=REPORT_ALL)
    run = tmp_path / "run"
    # Killed while saving step 4: steps 3 and 4 were logged, the checkpoint is step 2, so the resumed run trains
    # (and would log) steps 3 and 4 again.
    killed = subprocess.run([sys.executable, "-m", "gpupoor", "train", str(recipe), "--output-dir", str(run)],
                            env={**os.environ, "GPUPOOR_FAULT": "kill@start:4"}, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [step for step, _ in tensorboard_scalars(run, "train/loss")] == [1, 2, 3, 4]
    ids = json.loads((run / "trackers.json").read_text())
    resumed = invoke("resume", run, monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    assert "failed" not in resumed.output  # no tracker warned
    assert json.loads((run / "trackers.json").read_text()) == ids  # the same W&B and MLflow runs continue
    expected = steps_and_losses(run)
    assert [step for step, _ in expected] == [1, 2, 3, 4, 5, 6]
    for logged in (tensorboard_scalars(run, "train/loss"), mlflow_history(run, "train/loss")):
        assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]  # each step once
        assert [value for _, value in logged] == pytest.approx([loss for _, loss in expected], rel=1e-6)
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(run) if "eval_loss" in r]
    assert [step for step, _ in mlflow_history(run, "eval/loss")] == [step for step, _ in evals] == [3, 6]
    assert [step for step, _ in tensorboard_scalars(run, "eval/accuracy")] == [3, 6]
    assert {step for step, _ in tensorboard_scalars(run, "checkpoint/save_s")} == {2, 4, 6}
    # The recipe is the run's config.
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri()).get_run(ids["mlflow"]).data.params
    assert params["training.learning_rate"] == "0.01" and params["peft.rank"] == "4"
    # W&B: one offline run (resumed, not a second one: a session directory each, with the same id) that holds
    # every step once. The killed session's log lacks what W&B had not written when the kill came (here every
    # step): the resumed session sends what it lacks of metrics.jsonl, then of the steps it trains again.
    from gpupoor.train.trackers import wandb_offline_history

    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(ids["wandb"] in path.name for path in offline)
    history = wandb_offline_history(run, ids["wandb"])
    losses = [(step, values["train/loss"]) for step, values in history if "train/loss" in values]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in losses] == pytest.approx([loss for _, loss in expected], rel=1e-6)
    assert [step for step, values in history if "eval/loss" in values] == [3, 6]
    assert [step for step, values in history if "checkpoint/save_s" in values] == [2, 4, 6]


def test_a_w_and_b_offline_run_stopped_cleanly_is_not_sent_its_steps_again(make_recipe, tmp_path, monkeypatch):
    from gpupoor.train.trackers import wandb_offline_history

    recipe = make_recipe(training={"max_steps": 5}, logging={"report_to": ["wandb"], "offline": True,
                                                             "progress": "none"})
    run = tmp_path / "run"
    stopped = invoke("train", recipe, "--output-dir", run, fault="sigterm@3", monkeypatch=monkeypatch)
    assert stopped.exit_code == 75, stopped.output
    resumed = invoke("resume", run, monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    # The first session's log holds steps 1-3 (W&B wrote them at its orderly finish): read back, not sent again.
    history = wandb_offline_history(run, json.loads((run / "trackers.json").read_text())["wandb"])
    assert [step for step, values in history if "train/loss" in values] == [1, 2, 3, 4, 5]


def test_a_tracker_added_on_resume_gets_every_step_once(make_recipe, tmp_path, monkeypatch):
    recipe = make_recipe(training={"max_steps": 5})
    run = tmp_path / "run"
    stopped = invoke("train", recipe, "--output-dir", run, fault="sigterm@3", monkeypatch=monkeypatch)
    assert stopped.exit_code == 75, stopped.output
    resumed = invoke("resume", run, "--set", "logging.report_to=[tensorboard]", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    # Steps 1-3 from metrics.jsonl at the start, then 4 and 5 as they are trained.
    logged = tensorboard_scalars(run, "train/loss")
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5]
    assert [value for _, value in logged] == pytest.approx([loss for _, loss in steps_and_losses(run)], rel=1e-6)


def test_a_failing_tracker_warns_once_and_training_goes_on(make_recipe, tmp_path, monkeypatch):
    import accelerate.tracking

    calls = []

    def broken(self, values, step=None, **kwargs):
        calls.append(step)
        raise OSError("No space left on device")

    monkeypatch.setattr(accelerate.tracking.TensorBoardTracker, "log", broken)
    recipe = make_recipe(training={"max_steps": 4}, logging={"report_to": ["tensorboard"], "progress": "none"})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert result.output.count("tracker tensorboard failed") == 1 and "training goes on" in result.output
    assert calls == [1]  # dropped after its first failure
    assert [step for step, _ in steps_and_losses(tmp_path / "run")] == [1, 2, 3, 4]


@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_an_unreachable_mlflow_server_costs_seconds_and_one_warning(make_recipe, tmp_path, monkeypatch, server):
    import socket
    import time

    from gpupoor.train.trackers import MLFLOW_PATIENCE

    # refusing: a port nothing listens on, every request is refused at once. silent: the connection is made (the
    # kernel's backlog) and no answer ever comes, as from a server that hangs: each request times out.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if server == "refusing":
            listener.close()
        else:
            listener.listen(64)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        for key in MLFLOW_PATIENCE:  # unset, as for a user who never heard of them; restored after the test
            monkeypatch.delenv(key, raising=False)
        recipe = make_recipe(training={"max_steps": 3}, logging={"report_to": ["mlflow"], "progress": "none"})
        started = time.monotonic()
        result = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
        # MLflow's own retries held the start ~245 s (refusing) or ~19 min (silent) before the warning; a generous
        # bound, not a timing.
        assert time.monotonic() - started < 90, result.output
        assert result.exit_code == 0, result.output
        assert result.output.count("tracker mlflow failed") == 1 and "training goes on" in result.output
        assert [step for step, _ in steps_and_losses(tmp_path / "run")] == [1, 2, 3]


def test_a_tracker_that_is_not_installed_is_exit_2_at_validate_with_the_pip_command(make_recipe, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    result = invoke("validate", make_recipe(logging={"report_to": ["wandb"]}))
    assert result.exit_code == 2
    assert "logging.report_to" in result.output and "pip install 'gpupoor[wandb]'" in result.output


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
