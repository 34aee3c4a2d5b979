"""Knowledge distillation end to end (#14): a student learns the teacher's distributions, resumes bitwise, and a
teacher with another tokenizer is refused."""

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


def _kl_to_teacher(student_dir, adapter_dir, teacher_dir, rows) -> float:
    """Mean KL(teacher || student) per target token on `rows`, from full logits in float64."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpupoor.data.formats import Encoder
    from gpupoor.model.build import load_tokenizer
    from gpupoor.recipe.schema import ModelSection

    tokenizer = load_tokenizer(str(teacher_dir), ModelSection(name_or_path=str(teacher_dir)))
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64)
    if adapter_dir is not None:
        student = PeftModel.from_pretrained(student, adapter_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64)
    encoder = Encoder(tokenizer, "alpaca", 128)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            encoded = encoder.encode(row, "eval")
            ids = torch.tensor([encoded.input_ids])
            mask = torch.tensor(encoded.labels[1:]) != -100
            s = F.log_softmax(student.eval()(ids).logits[0, :-1][mask], -1)
            t = F.log_softmax(teacher.eval()(ids).logits[0, :-1][mask], -1)
            total += float((t.exp() * (t - s)).sum())
            count += int(mask.sum())
    return total / count


def test_a_distilled_student_moves_toward_its_teacher(make_recipe, teacher, tiny_model, tmp_path):
    from conftest import alpaca_rows

    common = {"training": {"max_steps": 24, "learning_rate": 3e-3}, "peft": {"method": "full"}}
    distilled = make_recipe("kd.yaml", distill={"teacher": str(teacher), "weight": 1.0, "temperature": 1.0}, **common)
    result = invoke("train", distilled, "--output-dir", tmp_path / "kd")
    assert result.exit_code == 0, result.output
    assert "fused distillation KL + cross-entropy" in result.output
    plain = make_recipe("ce.yaml", **common)
    assert invoke("train", plain, "--output-dir", tmp_path / "ce").exit_code == 0
    rows = alpaca_rows(48)[:16]  # what the teacher learned
    before = _kl_to_teacher(tiny_model, None, teacher, rows)
    after_kd = _kl_to_teacher(tmp_path / "kd" / "final", None, teacher, rows)  # full: final/ is the model
    after_ce = _kl_to_teacher(tmp_path / "ce" / "final", None, teacher, rows)
    assert after_kd < 0.8 * before, (before, after_kd, after_ce)
    assert after_kd < after_ce, (after_kd, after_ce)


def test_a_teacher_with_another_tokenizer_is_refused(make_recipe, tmp_path):
    from gpupoor.model.tiny import build_tiny_llama, train_tokenizer

    other = train_tokenizer(["completely different words for another vocabulary"] * 20, vocab_size=300)
    foreign = build_tiny_llama(tmp_path / "foreign", other, hidden=32, layers=2)
    result = invoke("train", make_recipe(distill={"teacher": str(foreign)}), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and "distill.teacher" in result.output and "tokenizer" in result.output
    assert not (tmp_path / "run").exists()
