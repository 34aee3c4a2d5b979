"""The system tier of test_trust.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.cli import invoke
from support.runs import read_metrics

from support.trust import _train_process


def test_an_eval_lost_to_a_crash_after_its_checkpoint_is_run_again(make_recipe, tmp_path, monkeypatch):
    sections = {"training": {"max_steps": 6, "eval_every_steps": 2}, "data": {"eval_rows": 8},
                "checkpoint": {"every_steps": 2}}
    straight = tmp_path / "straight"
    assert invoke("train", make_recipe("s.yaml", **sections), "--output-dir", straight,
                  monkeypatch=monkeypatch).exit_code == 0
    run = tmp_path / "crashed"
    # SIGKILL right after checkpoint step-4 is committed (the rotate stage), before the eval of step 4 is written.
    env = {**os.environ, "GPUPOOR_FAULT": "kill@rotate:4"}
    crashed = subprocess.run([sys.executable, "-m", "gpupoor", "train", str(make_recipe("c.yaml", **sections)),
                              "--output-dir", str(run)], env=env, capture_output=True, text=True)
    assert crashed.returncode == -9, crashed.stderr
    assert [r["step"] for r in read_metrics(run) if "eval_loss" in r] == [2]
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(run) if "eval_loss" in r]
    assert evals == [(r["step"], r["eval_loss"]) for r in read_metrics(straight) if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 4, 6]


def test_sigterm_during_startup_stops_at_step_0_with_a_checkpoint(make_recipe, tmp_path):
    run = tmp_path / "run"
    result = _train_process(make_recipe("s.yaml"), run, "sigterm@startup")
    assert result.returncode == 75, result.stderr
    assert (run / "checkpoints" / "step-000000" / "manifest.json").is_file()
    resumed = invoke("resume", run)
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]


def test_sigterm_after_the_stop_checkpoint_still_exits_75(make_recipe, tmp_path):
    run = tmp_path / "run"
    result = _train_process(make_recipe("s.yaml"), run, "sigterm@2,sigterm@stopped")
    assert result.returncode == 75, result.stderr
    assert "stopped after step 2 with checkpoint checkpoints/step-000002" in result.stdout


@pytest.mark.parametrize("fault, outcome, code", [("sigterm@3,", "continue with:", 75), ("", "done:", 0)])
def test_a_sigterm_while_resume_exits_keeps_the_exit_code(make_recipe, tmp_path, monkeypatch, fault, outcome, code):
    """Once the outcome is committed (the stop checkpoint, or final/), a signal while the process exits (a
    scheduler's second SIGTERM during the interpreter's shutdown) leaves the outcome's code, never a bare 143.
    The signal comes from the process itself once the command has returned (GPUPOOR_FAULT sigterm@exiting), so
    it always lands in the exit, however fast the machine."""
    run = tmp_path / "run"
    # stopped in this process (the integration tier's way): only the resume's exit needs a process of its own
    stopped = invoke("train", make_recipe("s.yaml"), "--output-dir", run, fault="sigterm@2", monkeypatch=monkeypatch)
    assert stopped.exit_code == 75, stopped.output
    result = subprocess.run([sys.executable, "-m", "gpupoor", "resume", str(run)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "GPUPOOR_FAULT": fault + "sigterm@exiting"})
    assert result.returncode == code, result.stderr[-3000:]
    assert outcome in result.stdout


def test_accelerate_launch_cpu_with_two_processes_is_refused_with_how_to_launch(make_recipe, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
                             "-m", "gpupoor", "train", str(make_recipe()), "--output-dir", str(run)],
                            capture_output=True, text=True, env={**os.environ, "GPUPOOR_FAULT": ""})
    # gpupoor exits 2 with the message; accelerate's launcher then reports its child's failure as its own exit 1.
    assert result.returncode != 0 and "returned non-zero exit status 2" in result.stderr, result.stderr
    assert "single process" in result.stderr and "torchrun --nproc-per-node" in result.stderr
    assert not run.exists()
