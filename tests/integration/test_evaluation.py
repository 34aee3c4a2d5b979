"""Evaluation that decides: token accuracy beside eval loss, early stopping (exit 0, the reason recorded, the
patience counter resumed exactly), the best checkpoint kept through rotation and copied into final/."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from support.batches import masked_batch
from support.cli import invoke
from support.runs import read_metrics

# min_delta 10: no eval after the first counts as an improvement, so patience 2 stops after the third eval
# (step 6) on any CPU, whatever the losses are; any fall of eval_loss still makes a new best.
EARLY = {"training": {"max_steps": 40, "eval_every_steps": 2, "early_stopping_patience": 2,
                      "early_stopping_min_delta": 10.0, "learning_rate": 0.05},
         "data": {"eval_rows": 6}, "checkpoint": {"keep_best": True, "final": "best", "keep_last": 1}}


def events(run, kind: str) -> list[dict]:
    return [r for r in read_metrics(run) if r.get("event") == kind]


def test_early_stopping_stops_with_exit_0_and_final_is_the_best_checkpoint(make_recipe, tmp_path):
    run = tmp_path / "run"
    result = invoke("train", make_recipe(**EARLY), "--output-dir", run)
    assert result.exit_code == 0, result.output
    assert "early stop: eval_loss did not improve" in result.output
    evals = [r for r in read_metrics(run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    [stop] = events(run, "early_stop")
    best = min(evals, key=lambda r: r["eval_loss"])
    assert stop["step"] == 6 and stop["best_step"] == best["step"] and stop["best_eval_loss"] == best["eval_loss"]
    # keep_last 1 keeps the newest checkpoint, and the best besides it.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert f"step-{best['step']:06d}" in names and "step-000006" in names
    # final/ is the best checkpoint's adapter, byte for byte, and says so.
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    assert manifest["step"] == best["step"] and manifest["stop"] == "early_stop"
    assert manifest["from_checkpoint"] == f"step-{best['step']:06d}"
    final = load_file(run / "final" / "adapter_model.safetensors")
    kept = load_file(run / "checkpoints" / f"step-{best['step']:06d}" / "adapter_model.safetensors")
    assert final.keys() == kept.keys() and all(torch.equal(final[k], kept[k]) for k in final)
    assert not (run / "final" / "optimizer.pt").exists()
    assert invoke("status", run).exit_code == 0
    # A finished, early-stopped run is not trained further by a plain resume...
    again = invoke("resume", run)
    assert again.exit_code == 0 and "already finished" in again.output
    # ...but is by a larger patience.
    more = invoke("resume", run, "--set", "training.early_stopping_patience=3")
    assert more.exit_code == 0, more.output
    assert [r["step"] for r in read_metrics(run) if "eval_loss" in r][-1] == 8


def test_an_interrupted_run_keeps_its_patience_and_best_exactly(make_recipe, tmp_path, monkeypatch):
    recipe = make_recipe(**EARLY)
    assert invoke("train", recipe, "--output-dir", tmp_path / "straight", monkeypatch=monkeypatch).exit_code == 0
    stopped = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch, fault="sigterm@4")
    assert stopped.exit_code == 75, stopped.output
    resumed = invoke("resume", tmp_path / "run", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output

    def decisive(run):
        return [{k: v for k, v in r.items() if k not in ("time", "save_s", "step_s", "elapsed_s", "tokens_per_s",
                                                          "peak_mem_mb", "predicted_peak_mb", "optimizer_state_mb")}
                for r in read_metrics(run) if "eval_loss" in r or r.get("event") in ("early_stop", "best")]

    assert decisive(tmp_path / "run") == decisive(tmp_path / "straight")
    a = load_file(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
