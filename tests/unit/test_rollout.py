"""GRPO's rollouts (gpupoor/objectives/rollout.py) on a tiny model: seeded sampling that a resume can repeat, and
the answers' log-probabilities lined up token for token with what generation sampled them from."""

from __future__ import annotations

import pytest
import torch

from gpupoor.objectives.rollout import answer_batch, answer_logprobs, sample_groups


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
        for i, (prompt, answer) in enumerate(zip(sampled.prompts, sampled.answers)):
            ids = torch.tensor([prompt])
            for t, token in enumerate(answer):  # one token at a time, no padding: the reference reading
                step = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), dim=-1)[token]
                assert float(logp[i, t]) == pytest.approx(float(step), abs=1e-4)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            assert mask[i].sum() == len(answer) and not mask[i, len(answer):].any()
