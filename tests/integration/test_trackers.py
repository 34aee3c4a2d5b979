"""Trackers (logging.report_to), read back with their own readers: TensorBoard's event files, MLflow's file store
through its client, W&B's offline run. Offline throughout; a resumed run continues the same tracker runs and logs
no step twice; a tracker that fails warns once and the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.cli import invoke
from support.runs import read_metrics
from support.trackers import _quiet_wandb, steps_and_losses, tensorboard_scalars


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
    assert f"tensorboard: tensorboard --logdir {(tmp_path / 'run').resolve() / 'tensorboard'}" in result.output
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
