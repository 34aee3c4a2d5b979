"""Knowledge distillation end to end (#14): the teacher the tests distill from, and a teacher with another tokenizer
is refused. (That a student learns: tests/system/test_distill_learning.py; that it resumes bitwise:
test_resume_matrix.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from support.cli import invoke
from support.runs import read_metrics
from support.distill import teacher


def test_a_teacher_with_another_tokenizer_is_refused(make_recipe, tmp_path):
    from gpupoor.model.tiny import build_tiny_llama, train_tokenizer

    other = train_tokenizer(["completely different words for another vocabulary"] * 20, vocab_size=300)
    foreign = build_tiny_llama(tmp_path / "foreign", other, hidden=32, layers=2)
    result = invoke("train", make_recipe(distill={"teacher": str(foreign)}), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and "distill.teacher" in result.output and "tokenizer" in result.output
    assert not (tmp_path / "run").exists()
