"""The time plan of `training.objective: grpo` (gpupoor.plan.time.grpo_work): sampling's and the update's FLOPs against
what torch's own FLOP counter counts when the rollout code runs them, and how sampling is spread over
grpo.iterations and the reference added with beta. Its accuracy in seconds is a benchmark
(bench/time_accuracy.py, docs/benchmarks.md), never a timed test."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gpupoor.objectives.cross_entropy import find_fused_head
from gpupoor.objectives.grpo.rollout import answer_batch, answer_logprobs, sample_groups, shared_prompt_logprobs
from gpupoor.plan.time.work import BatchFacts, step_work
from gpupoor.plan.time.grpo_work import grpo_step_work, reference_work, sampling_work, update_facts, update_work
from gpupoor.plan.settings import resolve_settings
from gpupoor.recipe.schema import Recipe
from support.plan import tiny_llama_with, tiny_shape

PROMPTS, GROUP, NEW, LENGTH, RANK = 2, 3, 5, 9, 8
FLOP_KINDS = ("matmul", "attention", "lora", "decode")


def grpo_settings(method: str = "lora", bits: int | None = None, **grpo):
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "x", "attention": "eager", "fused_layers": False},
        "quantization": {"bits": bits},
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
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.001)


@pytest.mark.parametrize("fused_head", [False, True], ids=["logits", "fused-head"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompts", "whole-rows"])
def test_the_planned_update_flops_are_what_torch_counts(policy_and_prompts, shared, fused_head):
    """The update reads each prompt once and its group's answers after it (under DDP or checkpointing every
    answer's row whole), forward and backward: LoRA's base frozen, no weight gradients but the adapters'; read
    once, the prompts' last layer takes no backward but through its keys and values. The head on the answer tokens
    (the fused head: their logits again in backward), or whole rows' logits on every position."""
    model, prompts, method = policy_and_prompts
    sampled = sample_groups(model, prompts, group_size=GROUP, max_new_tokens=NEW, pad_id=0, eos_id=None, seed=1,
                            share_prompts=True)
    head = find_fused_head(model)[0] if fused_head else None
    model.train()
    with FlopCounterMode(display=False) as counter:
        if shared:
            logp, mask = shared_prompt_logprobs(model, sampled, GROUP, NEW, pad_id=0, head=head)
        else:
            logp, mask = answer_logprobs(model, answer_batch(sampled, 0), NEW, head)
        logp[mask].sum().backward()
    shape, s = grpo_settings(method)
    s = replace(s, shared_prompts=shared, fused_loss=fused_head)
    update = update_facts(s, 1, PROMPTS * LENGTH, LENGTH)
    planned = flops_of(update_work(shape, s, update, PROMPTS * LENGTH, 1))
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.001)


def test_the_planned_reference_flops_are_what_torch_counts():
    """beta > 0: the answers' log-probabilities with the adapter switched off, each prompt read once, no
    backward."""
    model, _ = tiny_llama_with("lora", layers=2, rank=RANK, attention="eager", fused=False)
    prompts = torch.randint(1, 300, (PROMPTS, LENGTH), generator=torch.Generator().manual_seed(0)).tolist()
    sampled = sample_groups(model, prompts, group_size=GROUP, max_new_tokens=NEW, pad_id=0, eos_id=None, seed=3,
                            share_prompts=True)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), model.disable_adapter():
        shared_prompt_logprobs(model, sampled, GROUP, NEW, pad_id=0)
    shape, s = grpo_settings(beta=0.04)
    planned = flops_of(reference_work(shape, replace(s, fused_loss=False), update_facts(s, 1, PROMPTS * LENGTH,
                                                                                        LENGTH)))
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.001)


def test_the_planned_dora_sampling_flops_are_what_torch_counts():
    """DoRA rebuilds W + BA for its norms in every forward: in each of sampling's decode steps too."""
    model, _ = tiny_llama_with("dora", layers=2, rank=RANK, attention="eager", fused=False)
    prompts = torch.randint(1, 300, (PROMPTS, LENGTH), generator=torch.Generator().manual_seed(0)).tolist()
    with FlopCounterMode(display=False) as counter:
        sample_groups(model, prompts, group_size=GROUP, max_new_tokens=NEW, pad_id=0, eos_id=None, seed=0,
                      share_prompts=True)
    shape, s = grpo_settings("dora")
    work = sampling_work(shape, s, PROMPTS * LENGTH, LENGTH)
    assert by_key(work)["sampling_dora_norms"] > 0
    assert flops_of(work) == pytest.approx(counter.get_total_flops(), rel=0.001)


def test_quantized_weights_are_expanded_in_every_forward_of_sampling():
    shape, s = grpo_settings(bits=4)
    _, with_reference = grpo_settings(bits=4, beta=0.04)
    expanded = by_key(sampling_work(shape, s, PROMPTS * LENGTH, LENGTH))["sampling_dequantize"]
    assert expanded == shape.layer_linear_params * shape.layers * (NEW + 1)  # the prompts' forward, each new token
    update = update_facts(with_reference, 1, PROMPTS * LENGTH, LENGTH)
    assert by_key(reference_work(shape, with_reference, update))["reference_dequantize"] \
        == shape.layer_linear_params * shape.layers


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompts", "whole-rows"])
def test_the_update_is_linear_in_gradient_accumulation(shared):
    """Each micro-batch of a step is updated on alike: every term but the optimizer's grows with their count."""
    shape, s = grpo_settings()
    s = replace(s, shared_prompts=shared)
    update = update_facts(s, 1, PROMPTS * LENGTH, LENGTH)
    once, thrice = (by_key(update_work(shape, s, update, PROMPTS * LENGTH, n)) for n in (1, 3))
    assert thrice["optimizer"] == once["optimizer"]
    for key in set(once) - {"optimizer"}:
        assert thrice[key] == pytest.approx(3 * once[key]), key


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


def test_a_sessions_step_time_takes_whole_sampling_cycles():
    """With grpo.iterations N a step samples once in N: the step time `train` reports and records is the median of
    N-step means (after the first, warm-up step), never a median of update-only steps."""
    from gpupoor.run.reporting import TIME_CHECK_STEPS, time_check_steps, typical_step_s

    sample, update = 3.0, 1.0
    times = [9.0] + [sample if i % 3 == 2 else update for i in range(9)]  # steps 2-10: every third one samples
    assert typical_step_s(times, 3) == pytest.approx((sample + 2 * update) / 3)
    assert typical_step_s(times, 1) == update  # what a median of single steps would have said
    assert typical_step_s(times[:3], 3) is None  # not one whole cycle after the first step yet
    assert time_check_steps(1) == TIME_CHECK_STEPS and time_check_steps(4) == 9
