"""Knowledge distillation end to end (#14): the teacher the tests distill from, and a teacher with another tokenizer
is refused. (That a student learns: tests/system/test_distill_learning.py; that it resumes bitwise:
test_resume_matrix.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import invoke, read_metrics


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tokenizer):
    """A wider model than the student, fully fine-tuned on the test data: it knows something the student does
    not. Its final/ is a plain model directory with the student's tokenizer."""
    import yaml

    from conftest import alpaca_rows, write_jsonl
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


def test_a_teacher_with_another_tokenizer_is_refused(make_recipe, tmp_path):
    from gpupoor.model.tiny import build_tiny_llama, train_tokenizer

    other = train_tokenizer(["completely different words for another vocabulary"] * 20, vocab_size=300)
    foreign = build_tiny_llama(tmp_path / "foreign", other, hidden=32, layers=2)
    result = invoke("train", make_recipe(distill={"teacher": str(foreign)}), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and "distill.teacher" in result.output and "tokenizer" in result.output
    assert not (tmp_path / "run").exists()
