"""The system tier of test_preference.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import invoke
from support.runs import read_metrics

from support.preference import _one_thread, dpo_recipe, pairs_file


@pytest.mark.slow
def test_fsdp_processes_train_pairs_like_one_process_accumulating(make_recipe, pairs_file, tmp_path):
    """Two FSDP processes (gloo) with one pair each: every process runs the adapter-off reference forward and the
    policy's (collective), pairs are whole on each process, and the step's pairs are counted across them: the losses,
    rewards and evals of one process accumulating the same two pairs."""
    recipe = dpo_recipe(make_recipe, pairs_file, "fsdp.yaml", data={"eval_rows": 4},
                        training={"micro_batch_size": 1, "max_steps": 3, "eval_every_steps": 2})
    one = invoke("train", recipe, "--output-dir", tmp_path / "one", "--set", "training.gradient_accumulation_steps=2")
    assert one.exit_code == 0, one.output
    torchrun = Path(sys.executable).with_name("torchrun")
    two = subprocess.run([str(torchrun), "--nproc_per_node", "2", "-m", "gpupoor", "train", str(recipe), "--output-dir",
                          str(tmp_path / "two"), "--set", "distributed.strategy=fsdp"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "GPUPOOR_FAULT": ""})
    assert two.returncode == 0, two.stdout + two.stderr
    keys = ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "eval_loss", "eval_rewards/chosen")
    first, second = ([{k: r[k] for k in keys if k in r} for r in read_metrics(tmp_path / run) if "loss" in r or
                      "eval_loss" in r] for run in ("one", "two"))
    assert len(first) == len(second) == 5
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7) for k in a), (a, b)
