"""Shared by the merge tests (moved from integration/test_merge.py, whose tests still use them)."""

from __future__ import annotations

from pathlib import Path
import yaml

import pytest
from typer.testing import CliRunner

from support.rows import alpaca_rows, write_jsonl
from gpupoor.cli import app


runner = CliRunner()


def train_run(root: Path, model: Path, name: str, **sections) -> Path:
    data = write_jsonl(root / f"{name}.jsonl", alpaca_rows(32))
    recipe = {"model": {"name_or_path": str(model)}, "data": {"path": str(data), "format": "alpaca", "max_length": 128},
              "peft": {"rank": 4}, "training": {"micro_batch_size": 4, "max_steps": 6, "learning_rate": 2e-2,
                                                 "cpu_threads": 1, "warmup_steps": 0},
              "logging": {"progress": "none"}, "seed": 0}
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = runner.invoke(app, ["train", str(path), "--output-dir", str(root / name)])
    assert result.exit_code == 0, result.output
    return root / name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model) -> Path:
    return tmp_path_factory.mktemp("merge")


@pytest.fixture(scope="module")
def lora_run(workdir, tiny_model) -> Path:
    return train_run(workdir, tiny_model, "lora")


def merge(*args) -> object:
    return runner.invoke(app, ["merge-lora", *map(str, args)])


def assert_merges_as_trained_only_into_the_dequantized_base(run: Path, tmp_path: Path) -> None:
    """A QLoRA run merged into the dequantized 4-bit base gives the logits it trained with; merged into the
    original full-precision base it differs by the quantization error, far more."""
    dequantized = merge(run, "--output", tmp_path / "deq", "--verify")
    assert dequantized.exit_code == 0, dequantized.output
    original = merge(run, "--output", tmp_path / "orig", "--qlora-base", "original", "--verify")
    assert original.exit_code == 0, original.output

    def gap(output: str) -> float:
        return float(output.split("as trained = ")[1].split()[0])

    assert gap(dequantized.output) < 1e-4
    assert gap(original.output) > 100 * max(gap(dequantized.output), 1e-7)
