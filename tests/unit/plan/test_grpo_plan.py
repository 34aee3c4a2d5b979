"""The memory plan of `training.objective: grpo`: the update's rows are every sampled answer (prompt + answer), and
sampling's KV cache counts where it exceeds the update's working set (they never coexist)."""

from __future__ import annotations

from gpupoor.plan.peak import plan_terms
from gpupoor.plan.settings import resolve_settings
from gpupoor.plan.terms import activation_bytes, generation_bytes, grpo_update_bytes
from gpupoor.recipe.schema import Recipe

from support.plan import tiny_shape


def grpo_settings(checkpointing=False, group=4, new_tokens=32, micro=2, seq=64):
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "x"}, "data": {"path": "x.jsonl", "max_length": seq, "format": "alpaca"},
        "training": {"objective": "grpo", "micro_batch_size": micro},
        "grpo": {"group_size": group, "max_new_tokens": new_tokens},
        "memory": {"gradient_checkpointing": checkpointing}, "precision": "fp32"})
    shape = tiny_shape(2)
    return shape, resolve_settings(recipe, "cpu", shape)


def test_the_update_holds_every_answer_of_its_prompts():
    shape, s = grpo_settings()
    assert (s.micro_batch, s.row_tokens, s.sampled_answers, s.sampler) == (8, 96, 8, "length_grouped")
    cache, _ = generation_bytes(shape, s)
    # keys and values of each layer for every answer's row, fp32, beside each answer's fp32 logits (x4 copies)
    assert cache == 2 * 2 * shape.kv_heads * shape.head_dim * 8 * 96 * 4 + 8 * shape.vocab * 16


def test_sampling_counts_where_it_exceeds_the_update():
    for checkpointing in (False, True):
        shape, s = grpo_settings(checkpointing=checkpointing, new_tokens=512, seq=8)
        terms, assumptions = plan_terms(shape, s, uses_bitsandbytes=False)
        live, _, _, loss, _ = grpo_update_bytes(shape, s)
        generation = next(t for t in terms if t.key == "generation")
        assert generation.bytes == max(0, generation_bytes(shape, s)[0] - live - loss)
        assert "grpo.max_new_tokens" in assumptions[0] and "KV cache of 8 answers x 520 tokens" in generation.detail
        # Even with checkpointing, a layer's saved input (hidden wide) outweighs its keys and values (2 x kv
        # heads x head_dim: grouped-query attention): the update is the larger working set.
        assert generation.bytes == 0


def test_reading_each_prompt_once_is_planned_smaller_than_whole_rows():
    """One process without checkpointing reads each prompt once for its group: the plan keeps the prompts' layers
    once, the answers' for each answer, and the prompts' keys and values repeated for every answer; with
    checkpointing every answer's row is whole again."""
    shape, shared = grpo_settings(group=8, new_tokens=16, seq=128)
    assert shared.shared_prompts and (shared.prompt_rows, shared.prompt_tokens) == (2, 128)
    live, _, detail, _, _ = grpo_update_bytes(shape, shared)
    whole, _, _ = activation_bytes(shape, shared)  # 16 rows of 144 tokens
    assert live < whole / 3, (live, whole)
    assert "each read once for its group" in detail and "16 x 16 tokens" in detail
    _, checkpointed = grpo_settings(checkpointing=True, group=8, new_tokens=16, seq=128)
    assert not checkpointed.shared_prompts
    assert "each prompt with every answer" in grpo_update_bytes(shape, checkpointed)[2]
