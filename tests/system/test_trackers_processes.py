"""The system tier of test_trackers.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.cli import invoke
from support.runs import read_metrics

from support.trackers import REPORT_ALL, _quiet_wandb, mlflow_history, steps_and_losses, tensorboard_scalars


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
