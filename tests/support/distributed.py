"""Shared by the distributed tests (moved from system/test_distributed.py, whose tests still use them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
import yaml

import pytest

from support.rows import alpaca_rows, write_jsonl
from support.runs import read_metrics


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _run(command: list, fault: str = "", timeout: int = 300,
         env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUPOOR_FAULT": fault, **(env_extra or {})}
    return subprocess.run([str(c) for c in command], env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(*args, fault: str = "", env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return _run([TORCHRUN, "--nproc_per_node", "2", "-m", "gpupoor", *args], fault, env_extra=env_extra)


def one_process(*args, fault: str = "") -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "gpupoor", *args], fault)


def losses(run: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(run) if "loss" in r or "eval_loss" in r]


def exit_codes(result: subprocess.CompletedProcess) -> list[int]:
    """Each process's exit code from torchrun's failure report (torchrun itself exits 1 when any failed)."""
    return [int(line.split(":")[1].split()[0]) for line in result.stderr.splitlines()
            if line.strip().startswith("exitcode") and ":" in line]


# The module's recipe (4 steps, eval at 2 and 4, checkpoints every 2) on 48 alpaca rows and the tiny model: one
# recipe for all its runs, so the runs that are never interrupted are trained once (`straight`).
RECIPE = {"data": {"format": "alpaca", "max_length": 128, "sampler": "random", "eval_rows": 6},
          "peft": {"rank": 4},
          "training": {"micro_batch_size": 2, "max_steps": 4, "learning_rate": 1e-2, "cpu_threads": 1,
                       "warmup_steps": 0, "eval_every_steps": 2},
          "checkpoint": {"every_steps": 2, "time_limit": "1h"}, "logging": {"progress": "none"}, "seed": 0}


@pytest.fixture(scope="module")
def recipe(once_per_session, tiny_model) -> Path:
    """RECIPE as a file, written once per test session (every worker's straight runs train from it)."""
    def write(root: Path) -> None:
        root.mkdir()
        data = write_jsonl(root / "train.jsonl", alpaca_rows(48))
        recipe = {"model": {"name_or_path": str(tiny_model)}, **RECIPE,
                  "data": {"path": str(data), **RECIPE["data"]}}
        (root / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))

    return once_per_session(["test_distributed recipe", RECIPE], write) / "recipe.yaml"
