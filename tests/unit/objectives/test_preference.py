"""Preference tuning (DPO, ORPO): the losses and their gradients against the papers' formulas written out with
full logits, one sequence at a time and the reference from a separate frozen copy (float64); pairs kept whole
through encoding, packing and accumulation; the recipe's rules; a run end to end (exact resume, merge, generate,
QLoRA, the reference copy); and the demo task learned from preference pairs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import gpupoor.objectives.preference as preference
from support.cli import invoke
from support.rows import WORDS, write_jsonl
from support.runs import read_metrics
from gpupoor.data.build import collate_pairs, count_pairs
from gpupoor.data.dataset import encoded_chunk, tokenize_rows
from gpupoor.data.assembly import IGNORE_INDEX, Encoded
from gpupoor.data.encoder import Encoder
from gpupoor.data.loading import Row
from gpupoor.objectives.cross_entropy import find_fused_head
from gpupoor.objectives.preference import PreferenceLoss, Reference, frozen_head
from support.preference import _one_thread, close, pair_rows, pairs_file


# ------------------------------------------------------------------------------ the formulas, written out
def sequence_logp(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """log p(answer | prompt) of one sequence alone: the model's full logits, no batch, no padding."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].double()
    targets = labels[1:]
    keep = targets != IGNORE_INDEX
    return logits.log_softmax(-1)[keep].gather(1, targets[keep][:, None]).sum(), int(keep.sum())


def reference_loss(policy, frozen, pairs, objective: str, beta=0.1, loss_type="sigmoid", smoothing=0.0,
                   orpo_lambda=0.1) -> torch.Tensor:
    """DPO (Rafailov et al., eq. 7; IPO's and SLiC's hinge on the same margin; conservative DPO's smoothing) and
    ORPO (Hong et al., eq. 6-7) summed over pairs, the reference's log-probabilities from a frozen copy."""
    total = torch.zeros((), dtype=torch.float64)
    for (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) in pairs:
        chosen, chosen_tokens = sequence_logp(policy, chosen_ids, chosen_labels)
        rejected, rejected_tokens = sequence_logp(policy, rejected_ids, rejected_labels)
        if objective == "orpo":
            mean_chosen, mean_rejected = chosen / chosen_tokens, rejected / rejected_tokens
            odds = lambda p: p - torch.log(1 - torch.exp(p))  # noqa: E731 -- log(p / (1 - p)) of a log-probability
            total = total - mean_chosen - orpo_lambda * F.logsigmoid(odds(mean_chosen) - odds(mean_rejected))
            continue
        with torch.no_grad():
            ref_chosen = sequence_logp(frozen, chosen_ids, chosen_labels)[0]
            ref_rejected = sequence_logp(frozen, rejected_ids, rejected_labels)[0]
        h = (chosen - ref_chosen) - (rejected - ref_rejected)
        if loss_type == "sigmoid":
            total = total - (1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
        elif loss_type == "hinge":
            total = total + torch.relu(1 - beta * h)
        else:  # IPO on per-token log-ratios (TRL's normalization)
            per_token = (chosen - ref_chosen) / chosen_tokens - (rejected - ref_rejected) / rejected_tokens
            total = total + (per_token - 1 / (2 * beta)) ** 2
    return total


def dpo_rewards(policy, frozen, pairs, beta: float) -> dict[str, torch.Tensor]:
    """DPO's reward sums over the pairs (TRL's metrics): beta x (policy - reference) log-probability of each
    answer, their margin, and the pairs the chosen answer wins (a tie counts half)."""
    sums = {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/margins": 0.0}
    wins = 0.0
    with torch.no_grad():
        for chosen, rejected in pairs:
            chosen_reward = beta * (sequence_logp(policy, *chosen)[0] - sequence_logp(frozen, *chosen)[0])
            rejected_reward = beta * (sequence_logp(policy, *rejected)[0] - sequence_logp(frozen, *rejected)[0])
            sums["rewards/chosen"] += chosen_reward
            sums["rewards/rejected"] += rejected_reward
            sums["rewards/margins"] += chosen_reward - rejected_reward
            wins += 1.0 if chosen_reward > rejected_reward else 0.5 if chosen_reward == rejected_reward else 0.0
    return {**{key: torch.as_tensor(value) for key, value in sums.items()},
            "rewards/accuracies": torch.tensor(wins, dtype=torch.float64)}


@pytest.fixture(scope="module")
def pair_data(tokenizer):
    encoder = Encoder(tokenizer, "preference", max_length=64)
    return tokenize_rows([Row(row, f"pairs:{i + 1}") for i, row in enumerate(pair_rows(7))], encoder)


def _models(tiny_model, head: bool):
    """The policy: LoRA (and a trained copy of the head) with B and the head copy moved off their start, so the
    policy differs from the base; the frozen copy: the base loaded again. float64 throughout."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"] if head else None)
    policy = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * (0.2 if "lora_B" in name else 0.02))
    frozen = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    return policy, frozen


def _grads(model) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    model.zero_grad(set_to_none=True)
    return grads


CASES = [("dpo", "sigmoid", 0.0), ("dpo", "sigmoid", 0.2), ("dpo", "ipo", 0.0), ("dpo", "hinge", 0.0),
         ("orpo", None, 0.0)]


@pytest.mark.parametrize("objective, loss_type, smoothing", CASES)
@pytest.mark.parametrize("head", [False, True], ids=["lora", "lora+head"])
def test_loss_and_gradient_match_the_formula(tiny_model, pair_data, tokenizer, monkeypatch, objective, loss_type,
                                             smoothing, head):
    """Fused (chunks of 5 targets) and full-logits log-probabilities, padded and packed micro-batches: the loss
    and every trainable parameter's gradient equal the formula's. With the adapter switched off the model is its
    base: the reference equals the frozen copy's (and the base head, not the trained copy, is used)."""
    monkeypatch.setattr(preference, "loss_chunk_tokens", lambda vocab: 5)
    policy, frozen = _models(tiny_model, head)
    indices = [0, 3, 5, 6]
    pairs = [pair_data.sequences(i) for i in indices]
    expected = reference_loss(policy, frozen, pairs, objective, 0.3, loss_type, smoothing, orpo_lambda=0.4)
    expected.backward()
    expected_grads = _grads(policy)
    expected_rewards = dpo_rewards(policy, frozen, pairs, beta=0.3) if objective == "dpo" else {}
    fused, reason = find_fused_head(policy)
    assert fused is not None, reason
    for head_path in (fused, None):
        reference = Reference(policy, frozen_head(policy, head_path), adapter_off=True) if objective == "dpo" else None
        loss_fn = PreferenceLoss(objective, head_path, reference, beta=0.3, loss_type=loss_type or "sigmoid",
                                 label_smoothing=smoothing, orpo_lambda=0.4)
        for row_length in (None, 64):
            batch = collate_pairs(pair_data, indices, tokenizer.pad_token_id, row_length)
            assert count_pairs(batch) == len(indices)
            loss, sums = loss_fn(policy, batch)
            loss.backward()
            where = f"{'fused' if head_path else 'plain'}, {'packed' if row_length else 'padded'}"
            assert close(loss, expected, 1e-10), where
            assert close(_grads(policy), expected_grads, 1e-8), where
            if objective == "dpo":
                for key, value in expected_rewards.items():
                    assert close(sums[key], value, 1e-9), (where, key)
            assert 0 <= float(sums["rewards/accuracies"]) <= len(indices)


def test_the_log_probabilities_never_allocate_the_full_logits(monkeypatch):
    """Forward and backward of per-sequence log-probabilities hold one chunk of logits at a time (the backward
    recomputes them), never a tokens x vocabulary tensor."""
    from support.distill_loss import _largest_allocation_and_peak

    vocab, tokens, width = 16384, 512, 16
    monkeypatch.setattr(preference, "loss_chunk_tokens", lambda vocab: 32)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    sequence = torch.arange(tokens) // 64  # 8 sequences
    full_logits = tokens * vocab * 4  # one float32 tokens x vocab tensor: 32 MiB

    def chunked():
        sums = torch.zeros(8).index_add(0, sequence, preference.target_logprobs(hidden, weight, targets))
        (sums * torch.linspace(-1, 1, 8)).sum().backward()

    largest, peak = _largest_allocation_and_peak(chunked)
    assert largest < full_logits / 8 and peak < full_logits / 2, (largest, peak, full_logits)


def test_an_untrained_policy_scores_chance_against_its_reference(tiny_model, pair_data, tokenizer):
    """LoRA starts with B = 0: policy and reference agree, every margin is 0, the loss is log 2 per pair and the
    accuracy counts each tie as half a pair."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, target_modules="all-linear"))
    fused, _ = find_fused_head(policy)
    loss_fn = PreferenceLoss("dpo", fused, Reference(policy, frozen_head(policy, fused), adapter_off=True))
    loss, sums = loss_fn(policy, collate_pairs(pair_data, [0, 1, 2, 3], tokenizer.pad_token_id))
    assert float(loss.detach()) == pytest.approx(4 * 0.6931471805599453, rel=1e-6)
    assert float(sums["rewards/margins"]) == 0.0 and float(sums["rewards/accuracies"]) == 2.0


def test_the_adapter_off_reference_is_deterministic_under_the_base_models_dropout(tiny_model, tokenizer, pair_data):
    """The reference is a fixed function: with the base model's own attention dropout on and the policy in train
    mode, two reference passes over the same pairs agree exactly, and the policy is left in train mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, attention_dropout=0.5, attn_implementation="eager")
    policy = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).train()
    fused, _ = find_fused_head(policy)
    batch = collate_pairs(pair_data, [0, 1, 2, 3], tokenizer.pad_token_id)
    noisy = [Reference(policy, frozen_head(policy, fused), adapter_off=True, eval_mode=False).logps(batch)
             for _ in range(2)]
    assert not torch.equal(*noisy)  # the dropout is really there
    reference = Reference(policy, frozen_head(policy, fused), adapter_off=True)
    assert torch.equal(reference.logps(batch), reference.logps(batch))
    assert all(module.training for module in policy.modules())


# ----------------------------------------------------------------------------------------- rules and data
@pytest.mark.parametrize("sections, keys", [
    ({"training": {"objective": "dpo"}}, ("training.objective", "data.format")),
    ({"data": {"format": "preference"}}, ("data.format", "training.objective")),
    ({"training": {"objective": "dpo"}, "data": {"format": "preference"}, "distill": {"teacher": "x"}},
     ("training.objective", "distill")),
    ({"training": {"objective": "dpo"}, "data": {"format": "preference"}, "peft": {"method": "full"},
      "preference": {"reference": "adapter_off"}}, ("preference.reference", "peft.method")),
    ({"training": {"objective": "dpo"}, "data": {"format": "preference"},
      "preference": {"loss_type": "hinge", "label_smoothing": 0.2}}, ("preference.label_smoothing", "loss_type")),
])
def test_a_preference_recipe_must_be_coherent(make_recipe, sections, keys):
    """Exit 2, naming the keys that disagree."""
    result = invoke("validate", make_recipe("bad.yaml", **sections))
    assert result.exit_code == 2, result.output
    assert all(key in result.output for key in keys), result.output


def test_validate_checks_pairs_and_their_template(make_recipe, tmp_path):
    """Rows are checked in their format (file:line), and pairs of message lists need a chat template."""
    turns = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}
    for rows, named in (([{"prompt": "x", "chosen": "y"}], "pairs.jsonl:1: missing field 'rejected'"),
                        ([turns], "data.chat_template is not set")):
        data = {"path": str(write_jsonl(tmp_path / "pairs.jsonl", rows)), "format": "preference"}
        result = invoke("validate", make_recipe("v.yaml", data=data, training={"objective": "dpo"}))
        assert result.exit_code == 2 and named in result.output, result.output
    data["chat_template"] = "chatml"
    assert invoke("validate", make_recipe("v.yaml", data=data, training={"objective": "dpo"})).exit_code == 0


def test_pairs_are_encoded_whole(tokenizer, tmp_path):
    """A pair is one example (chosen sequence, then rejected): truncation keeps the prompt's end and the answers'
    start, the same prompt for both; message lists are rendered with the template and, without a `prompt`, the
    shared messages are the prompt; a pair with an answer cut away is dropped whole; bad rows name file:line."""
    from gpupoor.errors import UserError

    encoder = Encoder(tokenizer, "preference", max_length=16)
    prompt = " ".join(["sort"] * 30) + " reverse numbers"
    encoded = encoder.encode({"prompt": prompt, "chosen": " python lists", "rejected": " small data memory"}, "p:1")
    (start,) = encoded.sequence_starts
    chosen, rejected = encoded.input_ids[:start], encoded.input_ids[start:]
    assert encoded.truncated and len(chosen) <= 16 and len(rejected) <= 16
    answer = tokenizer(" python lists", add_special_tokens=False).input_ids
    assert chosen[-len(answer) - 1:] == answer + [tokenizer.eos_token_id]  # the whole answer and EOS kept
    ending = tokenizer(prompt, add_special_tokens=False).input_ids[-4:]
    assert [t for t in chosen if t not in answer][-5:-1] == ending  # the prompt's end kept
    assert chosen[:len(chosen) - len(answer) - 1] == rejected[:len(chosen) - len(answer) - 1]  # the same prompt

    chat = Encoder(tokenizer, "preference", max_length=64, chat_template="chatml")
    user = [{"role": "user", "content": "hi"}]
    implicit = chat.encode({"chosen": user + [{"role": "assistant", "content": "hello"}],
                            "rejected": user + [{"role": "assistant", "content": "stop"}]}, "p:2")
    explicit = chat.encode({"prompt": user, "chosen": [{"role": "assistant", "content": "hello"}],
                            "rejected": [{"role": "assistant", "content": "stop"}]}, "p:3")
    assert implicit == explicit
    trained = [t for t, label in zip(explicit.input_ids, explicit.labels) if label != IGNORE_INDEX]
    assert "hello" in tokenizer.decode(trained) and "hi" not in tokenizer.decode(trained)

    # (truncation always leaves each answer half of max_length; a pair whose one sequence has no target is dropped
    # whole, never split)
    chunk = encoded_chunk([Encoded([1, 5, 6, 1, 7], [IGNORE_INDEX, 5, 6, IGNORE_INDEX, IGNORE_INDEX], False, (3,)),
                           Encoded([1, 5, 1, 7], [IGNORE_INDEX, 5, IGNORE_INDEX, 7], False, (2,))])
    assert chunk.stats.dropped_no_target == 1 and chunk.lengths.tolist() == [4]
    assert chunk.target.tolist() == [0, 1, 2, 1]  # the rejected sequence starts at the 2
    with pytest.raises(UserError, match="p:5: missing field 'rejected'"):
        encoder.encode({"prompt": "x", "chosen": "y"}, "p:5")


def test_plan_counts_two_sequences_and_the_reference_copy(make_recipe, pairs_file):
    """A pair is two sequences: DPO's activations are those of twice the examples; a reference copy adds a
    second set of base weights (quantized with reference_bits), adapter_off adds none."""
    from gpupoor.plan.make import make_plan
    from gpupoor.recipe.loading import load_recipe

    def plan(**sections):
        return {t.key: t.bytes for t in make_plan(load_recipe(make_recipe("p.yaml", **sections)), "cpu").terms}

    sft = plan(training={"micro_batch_size": 4})
    dpo = plan(data={"path": str(pairs_file), "format": "preference"}, training={"objective": "dpo",
                                                                                 "micro_batch_size": 2})
    copy = plan(data={"path": str(pairs_file), "format": "preference"},
                training={"objective": "dpo", "micro_batch_size": 2}, preference={"reference": "copy"})
    assert dpo["activations"] == sft["activations"] and "reference_weights" not in dpo
    assert copy["reference_weights"] == dpo["base_weights"]


def test_trackers_get_the_reward_metrics():
    from gpupoor.train.trackers import PREFERENCE_METRICS, tracker_values

    assert set(preference.METRICS["orpo"]) <= set(PREFERENCE_METRICS)
    values = tracker_values({"step": 3, "loss": 0.6, "rewards/margins": 0.2, "eval_rewards/accuracies": 0.75})
    assert values["train/rewards/margins"] == 0.2 and values["eval/rewards/accuracies"] == 0.75
