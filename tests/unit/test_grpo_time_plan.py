"""The time plan of `training.objective: grpo` (gpupoor.plan.grpo_work): sampling's and the update's FLOPs against
what torch's own FLOP counter counts when the rollout code runs them, and how sampling is spread over
grpo.iterations and the reference added with beta. Its accuracy in seconds is a benchmark
(bench/time_accuracy.py, docs/benchmarks.md), never a timed test."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gpupoor.objectives.rollout import sample_groups, shared_prompt_logprobs
from gpupoor.plan.flops import BatchFacts, step_work
from gpupoor.plan.grpo_work import grpo_step_work, sampling_work, update_facts, update_work
from gpupoor.plan.settings import resolve_settings
from gpupoor.recipe.schema import Recipe
from support.plan import tiny_llama_with, tiny_shape

PROMPTS, GROUP, NEW, LENGTH, RANK = 2, 3, 5, 9, 8
FLOP_KINDS = ("matmul", "attention", "lora", "decode")


def grpo_settings(method: str = "lora", **grpo):
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "x", "attention": "eager", "fused_layers": False},
        "data": {"path": "x.jsonl", "max_length": 64, "format": "alpaca"}, "peft": {"rank": RANK, "method": method},
        "training": {"objective": "grpo", "micro_batch_size": PROMPTS},
        "grpo": {"group_size": GROUP, "max_new_tokens": NEW, **grpo}, "precision": "fp32"})
    shape = tiny_shape(2)
    return shape, resolve_settings(recipe, "cpu", shape)


@pytest.fixture(scope="module", params=["lora", "full"])
def policy_and_prompts(request):
    """The tiny Llama with peft's LoRA or trained whole (eager attention: its matmuls are ones the counter sees),
    and prompts of one length (no padding: the counted squares are the planned ones)."""
    model, _ = tiny_llama_with(request.param, layers=2, rank=RANK, attention="eager", fused=False)
    prompts = torch.randint(1, 300, (PROMPTS, LENGTH), generator=torch.Generator().manual_seed(0)).tolist()
    return model, prompts, request.param


def flops_of(work) -> float:
    return sum(w.amount for w in work if w.kind in FLOP_KINDS)


def test_the_planned_sampling_flops_are_what_torch_counts(policy_and_prompts):
    """The prompts into the KV cache (all but each one's last token), then max_new_tokens decode steps of every
    answer: the linears, LoRA's unmerged matmuls, the head and attention over the cache so far."""
    model, prompts, method = policy_and_prompts
    with FlopCounterMode(display=False) as counter:
        sampled = sample_groups(model, prompts, group_size=GROUP, max_new_tokens=NEW, pad_id=0, eos_id=None, seed=0,
                                share_prompts=True)
    assert all(len(a) == NEW for a in sampled.answers)  # no end-of-sequence: every answer is max_new_tokens long
    shape, s = grpo_settings(method)
    planned = flops_of(sampling_work(shape, s, PROMPTS * LENGTH, LENGTH))
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_the_planned_update_flops_are_what_torch_counts(policy_and_prompts):
    """The update reads each prompt once and its group's answers after it, forward and backward (LoRA: the base
    frozen, no weight gradients but the adapters'; the prompts' last layer backward only through its keys and
    values), the head on the answer tokens."""
    model, prompts, method = policy_and_prompts
    sampled = sample_groups(model, prompts, group_size=GROUP, max_new_tokens=NEW, pad_id=0, eos_id=None, seed=1,
                            share_prompts=True)
    model.train()
    with FlopCounterMode(display=False) as counter:
        logp, mask = shared_prompt_logprobs(model, sampled, GROUP, NEW, pad_id=0)
        logp[mask].sum().backward()
    shape, s = grpo_settings(method)
    assert s.shared_prompts
    update = update_facts(s, 1, PROMPTS * LENGTH, LENGTH)
    planned = flops_of(update_work(shape, s, update, PROMPTS * LENGTH, 1))
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.01)


def batch_of_prompts() -> BatchFacts:
    """The data as the loop collates it: each row a prompt of LENGTH tokens and an expected answer of 4."""
    rows = PROMPTS * (LENGTH + 4)
    return BatchFacts(10, rows, rows, PROMPTS * 4, PROMPTS * (LENGTH + 4) ** 2, PROMPTS * (LENGTH + 4) ** 2)


def by_key(work) -> dict[str, float]:
    return {w.key: w.amount for w in work}


def test_sampling_is_spread_over_the_iterations_and_the_reference_comes_with_beta():
    shape, once = grpo_settings()
    _, twice = grpo_settings(iterations=2)
    _, with_reference = grpo_settings(beta=0.04)
    plain, spread, referenced = (by_key(grpo_step_work(shape, s, batch_of_prompts(), accumulation=3))
                                 for s in (once, twice, with_reference))
    for key in ("prefill", "decode", "decode_calls", "decode_steps"):
        assert spread[key] == pytest.approx(plain[key] / 2) and plain[key] > 0
    assert spread["linears"] == plain["linears"] and spread["optimizer"] == plain["optimizer"]
    assert plain["decode_steps"] == 3 * NEW  # each micro-batch of the step samples max_new_tokens tokens
    assert "reference" not in plain and referenced["reference"] > 0


def test_reading_each_prompt_once_is_planned_as_less_work_than_whole_rows():
    """One process without checkpointing: P x (L - 1) + G x P x A tokens in the update; with checkpointing every
    answer's row whole, G x P x (L + A)."""
    shape, shared = grpo_settings()
    whole = replace(shared, shared_prompts=False)
    a, b = (update_facts(s, 1, PROMPTS * LENGTH, LENGTH) for s in (shared, whole))
    assert a.tokens == PROMPTS * (LENGTH - 1) + PROMPTS * GROUP * NEW
    assert b.tokens == PROMPTS * GROUP * (LENGTH + NEW) and a.targets == b.targets == PROMPTS * GROUP * NEW
    assert flops_of(step_work(shape, shared, a, 1)) < flops_of(step_work(shape, whole, b, 1))
