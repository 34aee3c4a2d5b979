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
from conftest import WORDS, invoke, read_metrics, write_jsonl
from gpupoor.data.build import collate_pairs, count_pairs
from gpupoor.data.dataset import encoded_chunk, tokenize_rows
from gpupoor.data.assembly import IGNORE_INDEX, Encoded
from gpupoor.data.encoder import Encoder
from gpupoor.data.loading import Row
from gpupoor.objectives.cross_entropy import find_fused_head
from gpupoor.objectives.preference import PreferenceLoss, Reference, frozen_head


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the runs' recipes use: two threads on two busy cores are many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pair_rows(count: int, seed: int = 0) -> list[dict]:
    """Pairs of different lengths: a prompt, two different answers."""
    rng = random.Random(seed)

    def words(low, high):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = []
    for _ in range(count):
        chosen = words(1, 9)
        rejected = words(1, 9)
        rows.append({"prompt": words(2, 10), "chosen": chosen, "rejected": rejected if rejected != chosen else
                     rejected + " stop"})
    return rows


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-9) -> bool:
    """Equal up to `rel` of b's norm."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm()) <= rel * max(float(b.norm()), 1e-30)


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
    from test_distill_loss import _largest_allocation_and_peak

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


# ------------------------------------------------------------------------------------------- runs end to end
@pytest.fixture()
def pairs_file(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", pair_rows(24))


def dpo_recipe(make_recipe, pairs_file, name: str, **sections):
    """A DPO recipe on the tiny model; keyword sections are merged over these."""
    merged = {"data": {"path": str(pairs_file), "format": "preference", "max_length": 64, "sampler": "random"},
              "training": {"objective": "dpo", "micro_batch_size": 2, "max_steps": 4},
              "preference": {"beta": 0.5}}
    for key, value in sections.items():
        merged[key] = {**merged.get(key, {}), **value}
    return make_recipe(name, **merged)


def steps(run) -> list[dict]:
    return [record for record in read_metrics(run) if "loss" in record]


def test_dpo_resumes_bitwise_and_the_adapter_merges_and_generates(make_recipe, pairs_file, tmp_path, monkeypatch):
    """Packed pairs, accumulation, dropout and evals: stopped mid-epoch (SIGTERM) and resumed, the run equals the
    straight one bit for bit (losses, reward metrics, adapter); its adapter merges into the base like peft's own
    merge and generates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = dpo_recipe(make_recipe, pairs_file, "exact.yaml", data={"sampler": "packed", "eval_rows": 4},
                        peft={"rank": 4, "dropout": 0.1},
                        training={"max_steps": 6, "gradient_accumulation_steps": 2, "eval_every_steps": 3})
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert invoke("train", recipe, "--output-dir", straight, monkeypatch=monkeypatch).exit_code == 0
    result = invoke("train", recipe, "--output-dir", stopped, fault="sigterm@4", monkeypatch=monkeypatch)
    assert result.exit_code == 75, result.output
    result = invoke("resume", stopped, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    records = [r for r in read_metrics(straight) if "loss" in r or "eval_loss" in r]
    assert records and all("rewards/margins" in r or "eval_rewards/margins" in r for r in records)
    strip = ("tokens_per_s", "step_s", "elapsed_s", "peak_mem_mb", "predicted_peak_mb", "optimizer_state_mb")
    assert [{k: v for k, v in r.items() if k not in strip} for r in records] == \
        [{k: v for k, v in r.items() if k not in strip} for r in read_metrics(stopped) if "loss" in r or "eval_loss" in r]
    first, second = (load_file(run / "final" / "adapter_model.safetensors") for run in (straight, stopped))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    assert invoke("merge-lora", straight, "--output", tmp_path / "merged").exit_code == 0
    base = AutoModelForCausalLM.from_pretrained(json.loads((straight / "final" / "adapter_config.json").read_text())
                                                ["base_model_name_or_path"])
    probe = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7]])
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, straight / "final").merge_and_unload()(probe).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(probe).logits
    assert close(merged, expected, 1e-5)
    result = invoke("generate", straight, "--prompt", "sort the lists", "--max-new-tokens", "6")
    assert result.exit_code == 0 and result.output.strip(), result.output


def test_pairs_are_the_unit_of_accumulation(make_recipe, pairs_file, tmp_path):
    """4 pairs x accumulation 1 and 1 pair x accumulation 4 take the same pairs per step: normalized by pairs, the
    first step's loss and gradient norm agree, and so do the reward metrics."""
    runs = {}
    for name, batch, accumulation in (("big", 4, 1), ("small", 1, 4)):
        recipe = dpo_recipe(make_recipe, pairs_file, f"{name}.yaml", training={
            "micro_batch_size": batch, "gradient_accumulation_steps": accumulation, "max_steps": 2,
            "max_grad_norm": None})
        assert invoke("train", recipe, "--output-dir", tmp_path / name).exit_code == 0
        runs[name] = steps(tmp_path / name)
    for big, small in zip(runs["big"], runs["small"]):  # step 2: the policy has moved off its reference
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/rejected"):
            # The margin is a difference of two rewards: its tolerance scales with them, not with itself.
            scale = abs(big["rewards/chosen"]) + abs(big["rewards/rejected"]) if key == "rewards/margins" else 0.0
            assert big[key] == pytest.approx(small[key], rel=1e-5, abs=1e-7 + 1e-5 * scale), (big["step"], key)
    assert runs["big"][0]["rewards/accuracies"] == 0.5  # the first step: policy = reference, every pair a tie
    assert runs["big"][1]["rewards/margins"] != 0.0


def test_reference_copy_equals_adapter_off_and_full_tuning_uses_a_copy(make_recipe, pairs_file, tmp_path):
    """With LoRA, a frozen copy of the base as DPO's reference gives the losses the adapter switched off gives;
    `full` fine-tuning takes the copy by itself (auto), quantized with reference_bits; ORPO runs with no
    reference."""
    losses = {}
    full = {"peft": {"method": "full"}, "training": {"learning_rate": 1e-3}}
    for name, sections in (("off", {}), ("copy", {"preference": {"reference": "copy"}}), ("full", full),
                           ("full4", {**full, "preference": {"reference_bits": 4}}),
                           ("orpo", {"training": {"objective": "orpo"}})):
        recipe = dpo_recipe(make_recipe, pairs_file, f"{name}.yaml", **sections)
        result = invoke("train", recipe, "--output-dir", tmp_path / name)
        assert result.exit_code == 0, result.output
        losses[name] = [r["loss"] for r in steps(tmp_path / name)]
        assert all(map(torch.isfinite, torch.tensor(losses[name]))), name
        assert {"off": "reference adapter_off", "copy": "reference copy", "full": "reference copy",
                "full4": "reference copy", "orpo": "ORPO (lambda 0.1"}[name] in result.output
    assert losses["copy"] == pytest.approx(losses["off"], rel=1e-6)
    for name in ("full", "full4"):  # a reference equal to the policy would keep every loss at log 2, margin 0
        assert steps(tmp_path / name)[-1]["rewards/margins"] != 0.0 and losses[name][-1] != losses[name][0], name
    assert "log_odds_chosen" in steps(tmp_path / "orpo")[0]


def test_qlora_dpo_trains(make_recipe, pairs_file, tmp_path):
    """DPO on a 4-bit base (the reference: the quantized base with the adapter off)."""
    recipe = dpo_recipe(make_recipe, pairs_file, "qlora.yaml", quantization={"bits": 4}, training={"max_steps": 2})
    result = invoke("train", recipe, "--output-dir", tmp_path / "qlora")
    assert result.exit_code == 0, result.output
    records = steps(tmp_path / "qlora")
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert records[0]["rewards/accuracies"] == 0.5


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


def test_identical_pairs_are_warned_at_validate_and_train(make_recipe, tmp_path):
    """A pair whose chosen and rejected answers are the same teaches nothing (the loss stays at ln 2): validate and
    train say how many there are and where the first is (#25)."""
    rows = pair_rows(24)
    for row in rows[5:8]:
        row["rejected"] = row["chosen"]
    some = write_jsonl(tmp_path / "some.jsonl", rows)
    result = invoke("validate", dpo_recipe(make_recipe, some, "some.yaml"))
    assert result.exit_code == 0, result.output
    assert "chosen is identical to rejected in 3 of 24 pairs (the first at " in result.output
    assert "some.jsonl:6)" in result.output and "ln 2" in result.output
    same = write_jsonl(tmp_path / "same.jsonl", [{**row, "rejected": row["chosen"]} for row in rows])
    recipe = dpo_recipe(make_recipe, same, "same.yaml", training={"max_steps": 1})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "warning: data.path: chosen is identical to rejected in all of 24 pairs (the first at " in result.output
    different = invoke("validate", dpo_recipe(make_recipe, write_jsonl(tmp_path / "ok.jsonl", pair_rows(24)), "ok.yaml"))
    assert different.exit_code == 0 and "identical to rejected" not in different.output, different.output


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


# ----------------------------------------------------------------------------------------------- the demo task
def test_dpo_on_the_demo_task_raises_reward_and_greedy_accuracy(tmp_path, monkeypatch):
    """The demo's reversal task, the documented two stages: a short SFT (a model that reverses some inputs), merged;
    then DPO with a new adapter on pairs (the reversal chosen, a wrong one rejected). On held-out pairs the reward
    accuracy climbs from 50% (the policy starts equal to its reference) toward 100%, and greedy decoding gets more
    reversals right."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpupoor.model.demo_task import preference_split
    from gpupoor.commands.generate import complete

    train, held_out = preference_split(2400, 100, prompt=lambda letters: f"{letters} = ")  # short prompts: fast
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in train])
    write_jsonl(tmp_path / "pairs.jsonl", train)
    write_jsonl(tmp_path / "held-out.jsonl", held_out)
    common = {"logging": {"progress": "none"}, "seed": 0}
    sft = {"model": {"name_or_path": "gpupoor:demo"}, "peft": {"rank": 32, "modules_to_save": ["embed_tokens", "lm_head"]},
           "data": {"path": "sft.jsonl", "format": "completion", "max_length": 64, "sampler": "random"},
           "training": {"micro_batch_size": 16, "max_steps": 65, "learning_rate": 2e-3, "warmup_steps": 0,
                        "cpu_threads": 1}, **common}
    (tmp_path / "sft.yaml").write_text(json.dumps(sft))
    assert invoke("train", tmp_path / "sft.yaml", "--output-dir", tmp_path / "sft").exit_code == 0
    assert invoke("merge-lora", tmp_path / "sft", "--output", tmp_path / "merged").exit_code == 0
    dpo = {"model": {"name_or_path": "merged"}, "peft": {"rank": 16},
           "data": {"path": "pairs.jsonl", "format": "preference", "max_length": 64, "sampler": "random",
                    "eval_path": "held-out.jsonl"},
           "training": {"objective": "dpo", "micro_batch_size": 16, "max_steps": 60, "learning_rate": 1e-3,
                        "warmup_steps": 0, "cpu_threads": 1, "eval_every_steps": 20},
           "preference": {"beta": 0.5}, **common}
    (tmp_path / "dpo.yaml").write_text(json.dumps(dpo))
    result = invoke("train", tmp_path / "dpo.yaml", "--output-dir", tmp_path / "dpo")
    assert result.exit_code == 0, result.output

    rewards = [r["eval_rewards/accuracies"] for r in read_metrics(tmp_path / "dpo") if "eval_loss" in r]
    assert rewards[-1] >= 0.8 and rewards[-1] >= rewards[0], rewards
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    prompts = [Encoder(tokenizer, "preference", 64).encode_prompt(row, "held-out") for row in held_out]

    def greedy(model) -> float:
        return sum(a == r["chosen"] for a, r in zip(complete(model, tokenizer, prompts, 12), held_out)) / len(held_out)

    before = greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))
    after = greedy(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"),
                                             tmp_path / "dpo" / "final"))
    assert after >= before + 0.1, (before, after, rewards)


@pytest.mark.slow
def test_fsdp_processes_train_pairs_like_one_process_accumulating(make_recipe, pairs_file, tmp_path):
    """Two FSDP processes (gloo) with one pair each: every process runs the adapter-off reference forward and the
    policy's (collective), pairs are whole on each process, and the step's pairs are counted across them: the losses,
    rewards and evals of one process accumulating the same two pairs."""
    recipe = dpo_recipe(make_recipe, pairs_file, "fsdp.yaml", data={"eval_rows": 4},
                        training={"micro_batch_size": 1, "max_steps": 3, "eval_every_steps": 2})
    one = invoke("train", recipe, "--output-dir", tmp_path / "one", "--set", "training.gradient_accumulation_steps=2")
    assert one.exit_code == 0, one.output
    torchrun = Path(sys.executable).with_name("torchrun")
    two = subprocess.run([str(torchrun), "--nproc_per_node", "2", "-m", "gpupoor", "train", str(recipe), "--output-dir",
                          str(tmp_path / "two"), "--set", "distributed.strategy=fsdp"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "GPUPOOR_FAULT": ""})
    assert two.returncode == 0, two.stdout + two.stderr
    keys = ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "eval_loss", "eval_rewards/chosen")
    first, second = ([{k: r[k] for k in keys if k in r} for r in read_metrics(tmp_path / run) if "loss" in r or
                      "eval_loss" in r] for run in ("one", "two"))
    assert len(first) == len(second) == 5
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7) for k in a), (a, b)
