"""What a run left, read back (metrics, losses, its final adapter) and compared; runs of the test recipe trained
once per module (`reference_runs`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cli import invoke
from support.recipes import write_recipe
from support.rows import alpaca_rows, write_jsonl


def reference_runs(tmp_path_factory, tiny_model):
    """`train(fault=None, **sections) -> run`: an uninterrupted run of the test recipe (on the same 48 rows
    as `alpaca_file`), trained once per module and recipe, for the module's tests to compare with or copy. A
    module fixture runs before the tests' own environment exists, so it sets its own cache and fault."""
    root = tmp_path_factory.mktemp("reference")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(48))
    runs: dict[tuple, Path] = {}

    def train(fault: str | None = None, **sections) -> Path:
        key = (fault, repr(sections))
        if key not in runs:
            run = root / f"run-{len(runs)}"
            recipe = write_recipe(root / f"recipe-{len(runs)}.yaml", tiny_model, data, **sections)
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setenv("GPUPOOR_CACHE", str(root / "cache"))
                result = invoke("train", recipe, "--output-dir", run, fault=fault, monkeypatch=monkeypatch)
            assert result.exit_code == 0, result.output
            runs[key] = run
        return runs[key]

    return train


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of every optimizer step a run recorded, in order."""
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def adapter(run: Path) -> dict:
    """The tensors of a run's final adapter, by name."""
    from safetensors.torch import load_file

    return load_file(run / "final" / "adapter_model.safetensors")


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs recorded the same losses and ended with the same adapter, bitwise (floats compared exactly)."""
    import torch

    assert losses(a) == losses(b)
    first, second = adapter(a), adapter(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def has_a_step(run: Path) -> bool:
    """A run recorded its first optimizer step (the session's start event comes before any step)."""
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and '"loss"' in metrics.read_text()
