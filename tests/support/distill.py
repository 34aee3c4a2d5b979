"""Shared by the distill tests (moved from integration/test_distill.py, whose tests still use them)."""

from __future__ import annotations

import pytest

from support.cli import invoke


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tokenizer):
    """A wider model than the student, fully fine-tuned on the test data: it knows something the student does
    not. Its final/ is a plain model directory with the student's tokenizer."""
    import yaml

    from support.rows import alpaca_rows, write_jsonl
    from gpupoor.model.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("teacher")
    base = build_tiny_llama(root / "base", tokenizer, hidden=48, layers=2, heads=4, kv_heads=2, seed=3)
    data = write_jsonl(root / "train.jsonl", alpaca_rows(48))
    recipe = root / "teacher.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(base)}, "data": {"path": str(data), "format": "alpaca", "max_length": 128},
        "peft": {"method": "full"}, "training": {"micro_batch_size": 4, "max_steps": 24, "learning_rate": 3e-3,
                                                 "cpu_threads": 1, "warmup_steps": 0},
        "logging": {"progress": "none"}, "seed": 0}))
    result = invoke("train", recipe, "--output-dir", root / "run")
    assert result.exit_code == 0, result.output
    return root / "run" / "final"
