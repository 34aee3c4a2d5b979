"""The system tier of test_resume.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import invoke, run_cli, signalled_once
from support.runs import adapter, assert_same_run, has_a_step, losses, read_metrics
from gpupoor.storage.checkpoint import STAGES

from support.resume import references, straight


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_sigkill_at_every_commit_stage_leaves_a_resumable_run(straight, tmp_path, monkeypatch, stage):
    recipe, reference = straight()
    run = tmp_path / "killed"
    killed = run_cli(["train", recipe, "--output-dir", run, "--set", "checkpoint.every_steps=2"],
                     {"GPUPOOR_FAULT": f"kill@{stage}:4"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # resumed in this process: the kill needs a process of its own, the resume only ~10 s more of imports
    resumed = invoke("resume", run, "--set", "checkpoint.every_steps=2", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    resumed_from = "step-000004" if stage == "rotate" else "step-000002"  # rotate runs after the commit
    assert f"resuming from {resumed_from}" in resumed.stdout
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert_same_run(reference, run)


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_resume_finishes(make_recipe, tmp_path, monkeypatch):
    recipe = make_recipe(training={"max_steps": 100000})
    run = tmp_path / "term"
    # Signalled once a step is recorded, however long this machine takes to start: a signal before the first step
    # tests another stop.
    stopped = signalled_once([sys.executable, "-m", "gpupoor", "train", recipe, "--output-dir", run],
                             lambda: has_a_step(run), signal.SIGTERM)
    out, err = stopped.stdout, stopped.stderr
    assert stopped.returncode == 75, err
    assert "SIGTERM" in err and f"continue with: gpupoor resume {run}" in out
    step = losses(run)[-1][0]
    assert (run / "checkpoints" / f"step-{step:06d}" / "manifest.json").is_file()
    resumed = invoke("resume", run, "--set", f"training.max_steps={step + 2}", monkeypatch=monkeypatch)  # (here)
    assert resumed.exit_code == 0, resumed.output
    assert [s for s, _ in losses(run)] == list(range(1, step + 3))


def test_a_run_dir_in_use_is_not_resumed_twice(straight, monkeypatch):
    _, run = straight()
    shutil.rmtree(run / "final")
    holder = ("import fcntl, sys, time; h = open(sys.argv[1], 'a+'); fcntl.flock(h, fcntl.LOCK_EX); "
              "print('locked', flush=True); time.sleep(3600)")  # holds the lock until killed below, however slow
    other = subprocess.Popen([sys.executable, "-c", holder, str(run / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        (run / "session.json").write_text(json.dumps({"pid": other.pid, "started": time.time() - 90,
                                                      "time_limit_s": 3600}))
        # 3600 s from 90 s ago: 58m left, minus however long this machine takes to get here.
        shown = invoke("status", run, monkeypatch=monkeypatch)
        assert shown.exit_code == 0, shown.output
        status = shown.output
        left = re.search(rf"running: pid {other.pid}, time limit left (\d+)m\b", status)
        assert left and 50 <= int(left.group(1)) <= 58, status
        result = invoke("resume", run, monkeypatch=monkeypatch)
        assert result.exit_code == 2 and "another gpupoor process is training" in result.output
    finally:
        other.kill()
        other.wait()
    # The kernel dropped the dead process's lock: nothing stale is left to block the run.
    after = invoke("status", run, monkeypatch=monkeypatch)
    assert after.exit_code == 0 and "not running" in after.output, after.output
    assert invoke("resume", run, monkeypatch=monkeypatch).exit_code == 0


@pytest.mark.slow
def test_two_processes_train_like_one_with_accumulation(make_recipe, tmp_path):
    """torchrun with 2 CPU processes (gloo DDP through accelerate): each process takes its own micro-batch
    of every pair, so the run equals one process accumulating 2 micro-batches per step. Each process evaluates
    its share of the eval batches; the reduced eval loss is the one process's."""
    recipe = make_recipe(training={"max_steps": 4, "micro_batch_size": 2, "eval_every_steps": 2},
                         data={"eval_rows": 10})
    torchrun = Path(sys.executable).with_name("torchrun")
    two = subprocess.run([str(torchrun), "--nproc_per_node", "2", "-m", "gpupoor", "train", str(recipe),
                          "--output-dir", str(tmp_path / "two")], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert "processes: 2 (DDP, gloo; auto: ddp)" in two.stdout
    # the one-process reference trains in this process (a process of its own only adds ~10 s of imports)
    one = invoke("train", recipe, "--output-dir", tmp_path / "one", "--set", "training.gradient_accumulation_steps=2")
    assert one.exit_code == 0, one.output
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    steps_a, steps_b = [r for r in a if "loss" in r], [r for r in b if "loss" in r]
    assert len(steps_b) == 4  # one process wrote the metrics
    for x, y in zip(steps_a, steps_b):
        assert x["tokens"] == y["tokens"] and x["target_tokens"] == y["target_tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    evals_a, evals_b = [r for r in a if "eval_loss" in r], [r for r in b if "eval_loss" in r]
    assert [r["step"] for r in evals_a] == [r["step"] for r in evals_b] == [2, 4]
    for x, y in zip(evals_a, evals_b):
        assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=1e-5)
    first, second = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    assert first.keys() == second.keys()
    # Two process layouts: gradients meet through gloo's all-reduce instead of in-place accumulation, so
    # equality is to rounding, relative to each tensor's size (bitwise on the machines tried). A process
    # that trained on the wrong micro-batch, or a wrong gradient scale, is off by far more.
    for name in first:
        assert (first[name].double() - second[name].double()).norm() <= 1e-5 * second[name].double().norm(), name
