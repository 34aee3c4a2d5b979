"""Paths that only a CUDA GPU exercises. Skipped without one; run on the device machine when lent."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from conftest import read_metrics
from gpupoor.cli import app

pytestmark = pytest.mark.gpu


def test_auto_precision_and_device_on_gpu(make_recipe, tmp_path):
    import torch

    result = CliRunner().invoke(app, ["train", str(make_recipe(training={"device": "auto", "max_steps": 4})),
                                      "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    expected = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    assert "device cuda" in result.output and f"precision {expected}" in result.output
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[-1]["peak_mem_mb"] > 0


def test_qlora_on_gpu(make_recipe, tmp_path):
    result = CliRunner().invoke(app, ["train", str(make_recipe(quantization={"bits": 4}, training={"max_steps": 4})),
                                      "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
