"""The plan of a bf16 run on the CPU: a base file in another dtype than the run's is converted at load, and its
pages stay resident beside the converted weights until the file is closed, a peak the step may not reach
(measured on the real model's fp32 directory trained in bf16 with checkpointing: 1191 MiB, planned 1186)."""

from __future__ import annotations

import pytest

from gpupoor.plan.peak import CPU_PROCESS_BASELINE, plan_terms
from gpupoor.plan.terms import tokenizer_bytes
from gpupoor.plan.settings import resolve_settings
from gpupoor.model.shape import Shape
from gpupoor.recipe.schema import Recipe

# SmolLM2-135M's shape, its file in `file_dtype`


def smollm2(file_dtype: str) -> Shape:
    return Shape("llama", 576, 1536, 30, 9, 3, 64, 49152, True, False, file_dtype=file_dtype)


def terms_of(shape: Shape, precision: str, checkpointing: bool) -> dict[str, int]:
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl", "max_length": 128},
                                    "peft": {"rank": 16}, "precision": precision,
                                    "training": {"micro_batch_size": 8},
                                    "memory": {"gradient_checkpointing": checkpointing}})
    terms, _ = plan_terms(shape, resolve_settings(recipe, "cpu", shape), False)
    return {term.key: term.bytes for term in terms}


def test_converting_an_fp32_file_to_bf16_at_load_is_the_peak_where_the_step_is_smaller():
    shape = smollm2("fp32")
    terms = terms_of(shape, "bf16", checkpointing=True)
    file_bytes = shape.total_params * 4
    assert terms["loading"] > 0
    assert sum(terms.values()) == CPU_PROCESS_BASELINE + tokenizer_bytes(shape)[0] + file_bytes + terms["base_weights"]
    assert terms["base_weights"] == shape.total_params * 2


@pytest.mark.parametrize("file_dtype, precision, checkpointing", [
    ("bf16", "bf16", True),  # no conversion: the tensors are views of the mapped file
    ("fp32", "fp32", True),
    ("fp32", "bf16", False),  # the step's activations outgrow the load
])
def test_no_loading_term_where_the_load_is_not_the_peak(file_dtype, precision, checkpointing):
    assert "loading" not in terms_of(smollm2(file_dtype), precision, checkpointing)
