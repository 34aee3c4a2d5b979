"""GRPO's rollouts (gpupoor/objectives/grpo/rollout.py) on a tiny model: seeded sampling that a resume can repeat, and
the answers' log-probabilities lined up token for token with what generation sampled them from."""

from __future__ import annotations

import pytest
import torch

from gpupoor.objectives.grpo.rollout import answer_batch, answer_logprobs, sample_groups


@pytest.fixture(scope="module")
def model_and_ids(tiny_model, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompts = [tokenizer("reverse a b c d")["input_ids"], tokenizer("sort")["input_ids"]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, prompts, pad, tokenizer.eos_token_id


def sample(model_and_ids, seed: int, **kw):
    model, prompts, pad, eos = model_and_ids
    return sample_groups(model, prompts, group_size=3, max_new_tokens=6, pad_id=pad, eos_id=eos, seed=seed, **kw)


def test_sampling_is_a_function_of_the_seed_and_leaves_the_global_rng_alone(model_and_ids):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = sample(model_and_ids, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream did not move
    again = sample(model_and_ids, seed=7)
    assert first.answers == again.answers and len(first.answers) == 6
    assert first.prompts[0] == first.prompts[2] != first.prompts[3]  # each prompt repeated group_size times
    assert any(sample(model_and_ids, seed=s).answers != first.answers for s in (8, 9, 10))


def test_the_answers_log_probs_are_the_distribution_they_were_sampled_from(model_and_ids):
    """A full forward of prompt + answer gives each answer token the log-probability the cached generation drew it
    with (temperature 1, no top-p): the alignment of prompts, answers, padding and the mask."""
    model, prompts, pad, eos = model_and_ids
    model.train()
    sampled = sample(model_and_ids, seed=3)
    assert model.training  # restored
    model.eval()
    with torch.no_grad():
        logp, mask = answer_logprobs(model, answer_batch(sampled, pad), max_new_tokens=6)
        hot, _ = answer_logprobs(model, answer_batch(sampled, pad), max_new_tokens=6, temperature=0.5)
        for i, (prompt, answer) in enumerate(zip(sampled.prompts, sampled.answers)):
            ids = torch.tensor([prompt])
            for t, token in enumerate(answer):  # one token at a time, no padding: the reference reading
                logits = model(input_ids=ids).logits[0, -1].double()
                step = torch.log_softmax(logits, dim=-1)[token]
                assert float(logp[i, t]) == pytest.approx(float(step), abs=1e-4)
                # at temperature t the distribution sampled from is softmax(logits / t)
                assert float(hot[i, t]) == pytest.approx(float(torch.log_softmax(logits / 0.5, dim=-1)[token]),
                                                         abs=1e-4)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            assert mask[i].sum() == len(answer) and not mask[i, len(answer):].any()


def lora_model(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))


def test_grpo_updates_move_probability_toward_the_better_answers_of_each_group(tiny_model, tokenizer):
    """On one rollout, a few updates of the GRPO loss raise the log-probability of the answers their group rated
    above average and lower those rated below, on average (they share the weights, so one answer may move with
    its neighbours): the policy moves toward what the reward prefers."""
    from gpupoor.objectives.grpo.loss import group_advantages, policy_loss

    model = lora_model(tiny_model)
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse a b c d", "sort d c b a")]
    sampled = sample_groups(model, prompts, group_size=4, max_new_tokens=8, pad_id=0, eos_id=tokenizer.eos_token_id,
                            seed=0)
    advantages = group_advantages(torch.tensor([float(i % 2) for i in range(8)]), 4)
    batch = answer_batch(sampled, 0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    before = None
    for _ in range(5):
        logp, mask = answer_logprobs(model, batch, 8)
        before = (logp * mask).sum(dim=1).detach() if before is None else before
        optimizer.zero_grad()
        policy_loss(logp, logp.detach(), advantages, mask).loss.backward()
        optimizer.step()
    with torch.no_grad():
        logp, mask = answer_logprobs(model, batch, 8)
    change = (logp * mask).sum(dim=1) - before
    assert change[advantages > 0].mean() > 0 > change[advantages < 0].mean(), change
    assert change[advantages > 0].mean() - change[advantages < 0].mean() > 0.3, change


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_gives_the_same_log_probs_and_gradients_as_full_logits(model_and_ids, temperature):
    """Through the fused head (chunked, the vocabulary's logits never whole) the answers' log-probabilities and
    their gradients are those of the full logits, at any sampling temperature (log softmax(logits / t))."""
    from gpupoor.objectives.cross_entropy import find_fused_head

    model, prompts, pad, eos = model_and_ids
    sampled = sample(model_and_ids, seed=5)
    batch = answer_batch(sampled, pad)
    head, why = find_fused_head(model)
    assert head is not None, why
    results = []
    for fused in (None, head):
        model.zero_grad()
        logp, mask = answer_logprobs(model, batch, 6, head=fused, temperature=temperature)
        (logp * mask).sum().backward()
        results.append((logp.detach(), mask, model.lm_head.weight.grad.clone()))
    (full, full_mask, full_grad), (chunked, chunked_mask, chunked_grad) = results
    assert torch.equal(full_mask, chunked_mask)
    assert float((full - chunked).abs().max()) < 1e-5
    assert float((full_grad - chunked_grad).norm() / full_grad.norm()) < 1e-5


@pytest.mark.parametrize("fused", [False, True])
def test_each_prompt_read_once_per_group_gives_the_same_log_probs_and_gradients(tiny_model, tokenizer, fused):
    """The update's shared-prompt reading (each prompt's KV cache computed once and continued by its group's
    answers) equals reading every prompt + answer row whole, in values and in every trained weight's gradient
    (prompts of different lengths: left padding in the cache, right padding in the answers)."""
    from gpupoor.objectives.cross_entropy import find_fused_head
    from gpupoor.objectives.grpo.rollout import shared_prompt_logprobs

    model = lora_model(tiny_model)
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse a b c d e f", "sort", "count to three")]
    sampled = sample_groups(model, prompts, group_size=3, max_new_tokens=7, pad_id=0,
                            eos_id=tokenizer.eos_token_id, seed=4)
    assert len({len(a) for a in sampled.answers}) > 1 or len({len(p) for p in prompts}) > 1
    head = find_fused_head(model)[0] if fused else None
    model.train()
    readings = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            logp, mask = shared_prompt_logprobs(model, sampled, 3, 7, 0, head=head, temperature=0.8)
        else:
            logp, mask = answer_logprobs(model, answer_batch(sampled, 0), 7, head=head, temperature=0.8)
        (logp * mask * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        readings.append((logp.detach(), mask, grads))
    (whole, whole_mask, whole_grads), (shared, shared_mask, shared_grads) = readings
    assert torch.equal(whole_mask, shared_mask)
    assert float((whole - shared).abs().max()) < 1e-5
    for name, grad in whole_grads.items():
        assert float((grad - shared_grads[name]).norm()) <= 1e-5 * max(float(grad.norm()), 1e-12), name


def test_sampling_with_each_prompt_read_once_draws_the_answers_of_reading_it_per_answer(model_and_ids):
    model, prompts, pad, eos = model_and_ids
    for kind in ({"temperature": 0.0}, {"temperature": 1.0}):
        plain = sample(model_and_ids, seed=11, **kind)
        shared = sample(model_and_ids, seed=11, share_prompts=True, **kind)
        assert plain.answers == shared.answers and plain.prompts == shared.prompts, kind
