"""The integration tier of test_preference.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch

from support.cli import invoke
from support.rows import write_jsonl
from support.runs import read_metrics
from gpupoor.data.encoder import Encoder

from support.preference import _one_thread, dpo_recipe, pair_rows, pairs_file, steps


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
            # A reward is beta (0.5) times a difference of two summed log-probabilities (policy and reference, ~84
            # here: an fp32 ulp of 8e-6), a margin the difference of two rewards: their tolerance scales with the
            # log-probabilities they are differences of (a few ulps), not with themselves.
            logps = {"rewards/chosen": 2 * abs(big["logps/chosen"]),
                     "rewards/margins": 2 * (abs(big["logps/chosen"]) + abs(big["logps/rejected"]))}.get(key, 0.0)
            assert big[key] == pytest.approx(small[key], rel=1e-5, abs=1e-7 + 0.5 * 1e-6 * logps), (big["step"], key)
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
