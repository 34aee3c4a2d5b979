"""`gpupoor plan` against the peak a real training run reaches: the demo's recipe on the real model
(SmolLM2-135M-Instruct, 30 layers, vocabulary 49,152, tied embeddings; 8 x 128 tokens, no checkpointing) trained
two steps in a fresh process, so its peak RSS is that run's alone. Two steps, because the peak creeps up over
longer runs (docs/benchmarks.md, "On the real model"); bench/plan_accuracy.py --real measures more recipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpupoor.cpu import this_cpus_bf16_units

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-iso-dates.yaml"


def test_the_plan_is_within_ten_percent_of_a_real_runs_peak(real_model_dir, tmp_path):
    assert_plan_within_ten_percent(real_model_dir, tmp_path, precision="fp32")


@pytest.mark.skipif(not this_cpus_bf16_units(), reason="a bf16 run here would be emulated: 5-90x slower matmuls on an "
                    "AVX2 CPU (docs/benchmarks.md has the figures measured by hand)")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_bf16_plan_is_within_ten_percent_of_a_real_runs_peak(real_model_dir, tmp_path, checkpointing):
    assert_plan_within_ten_percent(real_model_dir, tmp_path, precision="bf16",
                                   **{"memory.gradient_checkpointing": str(checkpointing).lower()})


def assert_plan_within_ten_percent(real_model_dir, tmp_path, **overrides):
    run_dir = tmp_path / "run"
    overrides = {"model.name_or_path": real_model_dir, "data.eval_path": "null", "training.max_steps": 2,
                 "logging.every_steps": 1, "logging.progress": "none", **overrides}
    command = [sys.executable, "-m", "gpupoor", "train", str(RECIPE), "--output-dir", str(run_dir)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "peak_mem_mb" in record]
    assert len(steps) == 2
    planned = steps[0]["predicted_peak_mb"]
    measured = max(record["peak_mem_mb"] for record in steps)
    assert abs(planned / measured - 1) <= 0.10, f"planned {planned:.0f} MiB, measured {measured:.0f} MiB"
