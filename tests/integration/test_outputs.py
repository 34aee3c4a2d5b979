"""What gpupoor writes for people and other tools: the generated recipe reference and the files of a merge."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from support.rows import alpaca_rows, write_jsonl
from gpupoor.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model) -> Path:
    root = tmp_path_factory.mktemp("outputs")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(16))
    recipe = {"model": {"name_or_path": str(tiny_model)}, "data": {"path": str(data), "format": "alpaca", "max_length": 128},
              "peft": {"rank": 4}, "training": {"micro_batch_size": 4, "max_steps": 2, "learning_rate": 2e-2,
                                                 "cpu_threads": 1, "warmup_steps": 0},
              "logging": {"progress": "none"}, "seed": 0}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = runner.invoke(app, ["train", str(root / "recipe.yaml"), "--output-dir", str(root / "run")])
    assert result.exit_code == 0, result.output
    return root / "run"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_merged_files_get_the_modes_open_and_mkdir_give(lora_run, tmp_path, umask):
    old = os.umask(umask)
    try:
        result = runner.invoke(app, ["merge-lora", str(lora_run), "--output", str(tmp_path / "merged")])
        (tmp_path / "plain.txt").write_text("x")
        (tmp_path / "plain-dir").mkdir()
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    out = tmp_path / "merged"
    modes = {path.name: _mode(path) for path in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == {name: _mode(tmp_path / "plain.txt") for name in modes}, \
        f"umask {umask:04o}: " + ", ".join(f"{name} {mode:04o}" for name, mode in sorted(modes.items()))
    assert _mode(out) == _mode(tmp_path / "plain-dir")
    if umask == 0o022:
        assert modes["model.safetensors"] == 0o644 and _mode(out) == 0o755
