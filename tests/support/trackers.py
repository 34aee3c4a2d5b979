"""Shared by the trackers tests (moved from integration/test_trackers.py, whose tests still use them)."""

from __future__ import annotations

import json
import os

import pytest

from support.runs import read_metrics


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
