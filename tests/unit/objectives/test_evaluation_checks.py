"""The unit tier of test_evaluation.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from support.batches import masked_batch
from support.cli import invoke


def test_fused_eval_accuracy_equals_the_full_logits_one(tiny_model, tokenizer):
    """Token accuracy from the fused head (an argmax per chunk of target rows) against the full logits' argmax,
    in float64 so no near-tie can fall differently on another CPU; the loss too."""
    from transformers import AutoModelForCausalLM

    from gpupoor.objectives.cross_entropy import find_fused_head, fused_eval_sums, plain_eval_sums

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
    fused, _ = find_fused_head(model)
    batch = masked_batch(tokenizer)
    with torch.no_grad():
        fused_loss, fused_right = fused_eval_sums(model, batch, fused)
        plain_loss, plain_right = plain_eval_sums(model, batch)
    assert int(fused_right) == int(plain_right)
    assert float(fused_loss) == pytest.approx(float(plain_loss), rel=1e-12)
    # It counts target tokens, never prompt, padding or hole positions.
    targets = int((batch["labels"][:, 1:] != -100).sum())
    assert 0 <= int(plain_right) <= targets


@pytest.mark.parametrize("sections, key", [
    ({"training": {"early_stopping_patience": 2}}, "training.early_stopping_patience"),
    ({"training": {"early_stopping_patience": 2}, "data": {"eval_rows": 4}}, "training.eval_every_steps"),
    ({"checkpoint": {"keep_best": True}}, "checkpoint.keep_best"),
    ({"checkpoint": {"final": "best"}, "data": {"eval_rows": 4}}, "checkpoint.final"),
])
def test_evaluation_settings_without_what_they_need_are_refused(make_recipe, sections, key):
    result = invoke("validate", make_recipe(**sections))
    assert result.exit_code == 2 and key in result.output
