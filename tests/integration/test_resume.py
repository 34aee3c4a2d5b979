"""Exact resume, the checkpoint commit protocol under crashes, preemption, time limits, recipe changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.cli import invoke
from support.runs import assert_same_run, losses, read_metrics, reference_runs
from support.resume import EXACT, references, straight


@pytest.fixture()
def straight_on_this_data(make_recipe, tmp_path, monkeypatch):
    """A recipe and its uninterrupted run, trained here: for a test that changes the run's data file."""

    def run(fault: str | None = None, **sections) -> tuple[Path, Path]:
        recipe = make_recipe("exact.yaml", **{**EXACT, **sections})
        out = tmp_path / f"straight-{fault or 'plain'}".replace("@", "-").replace(",", "_")
        result = invoke("train", recipe, "--output-dir", out, fault=fault, monkeypatch=monkeypatch)
        assert result.exit_code == 0, result.output
        return recipe, out

    return run


@pytest.mark.parametrize("stops, nan", [
    ([3], None),        # mid-epoch
    ([6], None),        # at the epoch boundary
    ([4], 4),           # right after a skipped (non-finite) step
    ([2, 5], None),     # resumed twice
])
def test_resume_is_bitwise_exact(straight, tmp_path, monkeypatch, stops, nan):
    nan_fault = f"nan@{nan}" if nan else None
    recipe, reference = straight(nan_fault)
    run = tmp_path / "interrupted"
    faults = ",".join(filter(None, [nan_fault, f"sigterm@{stops[0]}"]))
    result = invoke("train", recipe, "--output-dir", run, fault=faults, monkeypatch=monkeypatch)
    assert result.exit_code == 75, result.output
    assert f"continue with: gpupoor resume {run}" in result.output
    for index, stop in enumerate(stops):
        assert losses(run)[-1][0] == stop
        later = stops[index + 1] if index + 1 < len(stops) else None
        faults = ",".join(filter(None, [nan_fault, f"sigterm@{later}" if later else None]))
        result = invoke("resume", run, fault=faults, monkeypatch=monkeypatch)
        assert result.exit_code == (75 if later else 0), result.output
    if nan:
        assert any(r.get("skipped") for r in read_metrics(run))
    assert_same_run(reference, run)


def test_resume_after_time_limit_finishes_the_same_run(straight, make_recipe, tmp_path, monkeypatch):
    recipe, reference = straight()
    run = tmp_path / "limited"
    # A limit used up before the first step: every resume would stop there again, so it is bad input (exit 2,
    # not 75, which a scheduler would requeue forever); the step-0 checkpoint keeps the run, a new budget finishes.
    result = invoke("train", recipe, "--output-dir", run, "--time-limit", "0.001s", monkeypatch=monkeypatch)
    assert result.exit_code == 2 and "is too short for one optimizer step" in result.output
    assert (run / "checkpoints" / "step-000000" / "manifest.json").is_file()
    resumed = invoke("resume", run, "--time-limit", "10m", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0 and "checkpoint.time_limit: \"0.001s\" -> \"10m\"" in resumed.output
    assert_same_run(reference, run)


def test_a_time_limit_stop_without_a_limit_in_the_recipe_never_prints_none(make_recipe, tmp_path, monkeypatch):
    """The stop message names the recipe's limit when there is one, and never says "time limit None" (#25)."""
    result = invoke("train", make_recipe(), "--output-dir", tmp_path / "run", fault="timeout@2", monkeypatch=monkeypatch)
    assert result.exit_code == 75, result.output
    assert "time limit nearly reached: stopped after step 2" in result.output and "None" not in result.output


def test_resuming_a_finished_run_says_so(straight, monkeypatch):
    _, run = straight()
    before = (run / "metrics.jsonl").read_text()
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0 and "already finished at step 9" in result.output
    assert (run / "metrics.jsonl").read_text() == before


def test_extending_a_finished_run_continues_it(straight, make_recipe, tmp_path, monkeypatch):
    _, run = straight()
    result = invoke("resume", run, "--set", "training.max_steps=11", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert "training.max_steps: 9 -> 11" in result.output
    assert [s for s, _ in losses(run)] == list(range(1, 12))


def test_trajectory_change_is_refused_with_a_diff_and_forced(straight, monkeypatch):
    recipe, run = straight()
    shutil.rmtree(run / "final")  # pretend it was interrupted at the end
    result = invoke("resume", run, "--set", "training.learning_rate=0.5", "--set", "seed=3", monkeypatch=monkeypatch)
    assert result.exit_code == 2
    assert "training.learning_rate: 0.01 -> 0.5" in result.output and "seed: 0 -> 3" in result.output
    assert "--force" in result.output
    forced = invoke("resume", run, "--set", "training.learning_rate=0.5", "--force", monkeypatch=monkeypatch)
    assert forced.exit_code == 0 and "--force: resuming with trajectory changes" in forced.output
    assert "seed: 0" in (run / "recipe.yaml").read_text()  # the refused change was never written


def test_forced_learning_rate_change_takes_effect(straight, tmp_path, monkeypatch):
    recipe, _ = straight()
    run = tmp_path / "lr"
    assert invoke("train", recipe, "--output-dir", run, fault="sigterm@4", monkeypatch=monkeypatch).exit_code == 75
    before = {r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r}
    result = invoke("resume", run, "--set", "training.learning_rate=0.001", "--force", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    after = {r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r}
    from gpupoor.train.optim import lr_factor

    # the same schedule position (cosine over 9 steps, no warmup), scaled from the new peak learning rate
    assert after[5] == pytest.approx(0.001 * lr_factor(4, 0, 9, "cosine"))
    assert before[4] == pytest.approx(0.01 * lr_factor(3, 0, 9, "cosine"))
    assert "learning_rate: 0.001" in (run / "recipe.yaml").read_text()


def test_changed_data_is_refused(straight_on_this_data, alpaca_file, monkeypatch):
    _, run = straight_on_this_data()
    shutil.rmtree(run / "final")
    alpaca_file.write_text(alpaca_file.read_text() + json.dumps({"instruction": "x", "output": "y"}) + "\n")
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 2 and "fingerprint changed" in result.output


def test_base_weights_replaced_at_the_same_path_are_refused_and_forced(make_recipe, tokenizer, tmp_path,
                                                                       monkeypatch):
    # Resume fingerprinted the data but not the model: other base weights at the same path gave exit 0 and another
    # adapter (issue #25). Each checkpoint records the model's files by sha256; a change is exit 2 unless --force.
    from gpupoor.storage.files import sha256_file
    from gpupoor.model.tiny import build_tiny_llama

    base = build_tiny_llama(tmp_path / "base", tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, seed=0)
    recipe = make_recipe("exact.yaml", model={"name_or_path": str(base)}, **EXACT)
    run = tmp_path / "run"
    assert invoke("train", recipe, "--output-dir", run, fault="sigterm@3", monkeypatch=monkeypatch).exit_code == 75
    manifest = json.loads((run / "checkpoints" / "step-000003" / "manifest.json").read_text())
    recorded = manifest["models"]["model.name_or_path"]
    assert recorded["path"] == str(base)
    assert recorded["files"]["model.safetensors"]["sha256"] == sha256_file(base / "model.safetensors")
    assert invoke("resume", run, fault="sigterm@4", monkeypatch=monkeypatch).exit_code == 75  # unchanged: resumes
    shutil.rmtree(base)
    build_tiny_llama(base, tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, seed=7)  # same shapes, other weights
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 2, result.output
    assert f"model.name_or_path: {base}: model.safetensors changed" in result.output
    assert "since checkpoint step-000004" in result.output and "--force" in result.output
    assert "config.json" not in result.output  # only what changed is named
    assert losses(run)[-1][0] == 4  # nothing was trained on the new weights
    forced = invoke("resume", run, "--force", monkeypatch=monkeypatch)
    assert forced.exit_code == 0, forced.output
    assert "--force: resuming with changed models" in forced.output and "model.safetensors changed" in forced.output
    event = next(r for r in read_metrics(run) if r.get("event") == "model_changed")
    assert event["key"] == "model.name_or_path" and event["step"] == 4 and "model.safetensors changed" in event["change"]
    final = json.loads((run / "final" / "manifest.json").read_text())["models"]["model.name_or_path"]
    assert final["files"]["model.safetensors"]["sha256"] == sha256_file(base / "model.safetensors")


def test_a_checkpoint_without_model_identities_still_resumes(straight, tmp_path, monkeypatch):
    recipe, reference = straight()
    run = tmp_path / "older"
    assert invoke("train", recipe, "--output-dir", run, fault="sigterm@3", monkeypatch=monkeypatch).exit_code == 75
    checkpoint = run / "checkpoints" / "step-000003"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["models"]  # as written before the record existed
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert invoke("resume", run, monkeypatch=monkeypatch).exit_code == 0
    assert_same_run(reference, run)


def test_a_moved_run_dir_still_resumes(straight, tmp_path, monkeypatch):
    recipe, reference = straight()
    run = tmp_path / "before-move"
    assert invoke("train", recipe, "--output-dir", run, fault="sigterm@4", monkeypatch=monkeypatch).exit_code == 75
    moved = tmp_path / "elsewhere" / "after-move"
    moved.parent.mkdir()
    shutil.move(run, moved)
    assert str(run) not in (moved / "recipe.yaml").read_text()
    assert invoke("resume", moved, monkeypatch=monkeypatch).exit_code == 0
    assert_same_run(reference, moved)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "no-manifest"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(straight, tmp_path, monkeypatch, damage):
    recipe, reference = straight()
    run = tmp_path / "damaged"
    result = invoke("train", recipe, "--output-dir", run, "--set", "checkpoint.every_steps=2",
                    fault="sigterm@5", monkeypatch=monkeypatch)
    assert result.exit_code == 75
    newest = run / "checkpoints" / "step-000005"
    target = newest / ("manifest.json" if damage == "no-manifest" else "adapter_model.safetensors")
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    status = invoke("status", run, monkeypatch=monkeypatch)
    assert status.exit_code == 0, status.output
    assert "step-000005  INVALID" in status.output and "step-000004  step 4" in status.output
    result = invoke("resume", run, "--set", "checkpoint.every_steps=2", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert "skipping checkpoint step-000005" in result.output and "resuming from step-000004" in result.output
    assert_same_run(reference, run)


def test_disk_full_keeps_the_previous_checkpoint(straight, tmp_path, monkeypatch):
    recipe, reference = straight()
    run = tmp_path / "full"
    result = invoke("train", recipe, "--output-dir", run, "--set", "checkpoint.every_steps=2",
                    fault="enospc@optimizer:4", monkeypatch=monkeypatch)
    assert result.exit_code == 1 and "disk full" in result.output and "needs about" in result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # no partial left
    assert invoke("resume", run, "--set", "checkpoint.every_steps=2", monkeypatch=monkeypatch).exit_code == 0
    assert_same_run(reference, run)


def test_too_little_free_space_is_refused_before_writing(make_recipe, tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    result = invoke("train", make_recipe(checkpoint={"every_steps": 2}), "--output-dir", tmp_path / "run",
                    monkeypatch=monkeypatch)
    assert result.exit_code == 1 and "not enough disk space" in result.output and "needs about" in result.output


def test_diverging_run_stops_after_consecutive_skips(make_recipe, tmp_path, monkeypatch):
    recipe = make_recipe(training={"max_steps": 9, "max_consecutive_skips": 3}, checkpoint={"every_steps": 1})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", fault="nan@3,nan@4,nan@5",
                    monkeypatch=monkeypatch)
    assert result.exit_code == 1 and "3 optimizer steps in a row" in result.output
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if r.get("skipped")] == [3, 4, 5]
    # the weights never went non-finite (skipped steps do not update), so checkpoints stay usable
    assert (tmp_path / "run" / "checkpoints" / "step-000005").is_dir()


def test_skipped_steps_are_warned_during_and_after_the_run(make_recipe, tmp_path, monkeypatch):
    """Steps skipped as non-finite are not silent (#25): a warning at the first, the count at the end (and in
    the end event of metrics.jsonl); the run still finishes (exit 0) while some steps learned."""
    recipe = make_recipe(training={"max_steps": 6})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", fault="nan@2,nan@4,nan@5",
                    monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert result.output.count("was skipped: its loss (nan)") == 1 and "warning: step 2 was skipped" in result.output
    assert "warning: 3 of 6 optimizer steps were skipped" in result.output and "learned from 3" in result.output
    assert "training.learning_rate (now 0.01)" in result.output
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if r.get("nonfinite")] == [2, 4, 5]
    end = [r for r in records if r.get("event") == "end"]
    assert end == [{"step": 6, "event": "end", "reason": "done", "skipped_steps": 3, "nonfinite_steps": 3}]
    status = invoke("status", tmp_path / "run", monkeypatch=monkeypatch)
    assert status.exit_code == 0 and "warning: 3 of 6 logged steps were skipped for a non-finite loss" in status.output


def test_a_run_whose_every_step_is_skipped_fails(make_recipe, tmp_path, monkeypatch):
    """Fewer steps than training.max_consecutive_skips, all of them non-finite: the weights never changed, so the
    run fails (exit 1) instead of writing an untrained final/ and exiting 0 (#25)."""
    recipe = make_recipe(training={"max_steps": 3})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", fault="nan@1,nan@2,nan@3",
                    monkeypatch=monkeypatch)
    assert result.exit_code == 1, result.output
    assert "every one of the 3 optimizer steps had a non-finite loss or gradient norm" in result.output
    assert not (tmp_path / "run" / "final").exists()


def test_status_shows_progress_checkpoints_and_the_command(straight, tmp_path, monkeypatch):
    recipe, _ = straight()
    run = tmp_path / "s"
    stopped = invoke("train", recipe, "--output-dir", run, "--set", "checkpoint.every_steps=3", fault="sigterm@4",
                     monkeypatch=monkeypatch)
    assert stopped.exit_code == 75, stopped.output
    status = invoke("status", run, monkeypatch=monkeypatch)
    assert status.exit_code == 0, status.output
    out = status.output
    assert "progress: step 4/9" in out and "step-000004  step 4  loss" in out and "valid" in out
    assert f"continue with: gpupoor resume {run}" in out


def test_bad_lines_in_metrics_never_block_a_resume(straight, tmp_path, monkeypatch):
    from support.report import BAD_LINES, insert_bad_line

    recipe, reference = straight()
    stopped = tmp_path / "stopped"
    result = invoke("train", recipe, "--output-dir", stopped, "--set", "checkpoint.every_steps=3", fault="sigterm@4",
                    monkeypatch=monkeypatch)
    assert result.exit_code == 75, result.output
    for kind, line in BAD_LINES.items():
        run = tmp_path / kind.replace(" ", "-")
        shutil.copytree(stopped, run)
        insert_bad_line(run, line, at=2)
        resumed = invoke("resume", run, monkeypatch=monkeypatch)
        assert resumed.exit_code == 0, (kind, resumed.output)
        assert resumed.output.count(f"warning: {run / 'metrics.jsonl'}: skipped 1 line that is not a metrics "
                                    "record (line 2: ") == 1, (kind, resumed.output)
        assert "the resume rewrites it without them" in resumed.output
        assert losses(run) == losses(reference), kind  # every step once, no good record lost


def test_resume_time_limit_and_profile_are_for_that_invocation_only(make_recipe, tmp_path):
    """--set changes become the run's; --time-limit and --profile budget and profile this resume only, so a later
    resume without them does not inherit them."""
    import yaml

    from support.cli import invoke

    run = tmp_path / "run"
    assert invoke("train", make_recipe(training={"max_steps": 2}), "--output-dir", run).exit_code == 0
    result = invoke("resume", run, "--set", "training.max_steps=4", "--time-limit", "5h", "--profile", "1")
    assert result.exit_code == 0, result.output
    stored = yaml.safe_load((run / "recipe.yaml").read_text())
    assert stored["training"]["max_steps"] == 4
    assert stored["checkpoint"].get("time_limit") is None
    assert stored["logging"].get("profile_steps") is None
