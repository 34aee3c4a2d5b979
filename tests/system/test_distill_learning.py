"""Learning quality of distillation (#14): a distilled student moves toward its teacher's distributions, further
than the same training without the teacher."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from support.cli import invoke

from support.distill import teacher


def _kl_to_teacher(student_dir, adapter_dir, teacher_dir, rows) -> float:
    """Mean KL(teacher || student) per target token on `rows`, from full logits in float64."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpupoor.data.encoder import Encoder
    from gpupoor.model.load import load_tokenizer
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
    from support.rows import alpaca_rows

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
