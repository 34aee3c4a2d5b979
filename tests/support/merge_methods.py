"""Shared by the merge_methods tests (moved from unit/model/test_merge_methods.py, whose tests still use them)."""

from __future__ import annotations

from pathlib import Path
import yaml

from typer.testing import CliRunner

from support.rows import alpaca_rows, write_jsonl
from gpupoor.cli import app


runner = CliRunner()


def train_run(root: Path, model: Path, name: str, method: str, **sections) -> Path:
    data = write_jsonl(root / f"{name}.jsonl", alpaca_rows(32))
    recipe = {"model": {"name_or_path": str(model)}, "data": {"path": str(data), "format": "alpaca", "max_length": 128},
              "peft": {"method": method, **({} if method == "ia3" else {"rank": 4})},
              "training": {"micro_batch_size": 4, "max_steps": 6, "learning_rate": 2e-2, "cpu_threads": 1,
                           "warmup_steps": 0},
              "logging": {"progress": "none"}, "seed": 0, **sections}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = runner.invoke(app, ["train", str(path), "--output-dir", str(root / name)])
    assert result.exit_code == 0, result.output
    return root / name
