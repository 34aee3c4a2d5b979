"""The training methods on the real model (SmolLM2-135M-Instruct, from the dequantized directory of the
`real_model_dir` fixture), each run once through the CLI as a user runs it, on a few rows of the real demo's
task (recipes/data/iso-dates-*.jsonl, the model's own chat template): an exact resume after SIGKILL, QLoRA
(nf4, double quantization), DoRA with merge-lora, and DPO on real preference pairs. Short runs (a handful of rows,
up to 6 steps): what the tiny random models of the other tiers cannot show is that it all holds on real
weights, a real tokenizer and template, tied embeddings and GQA."""

from __future__ import annotations

import json
import math
import re
import signal
import sys
from pathlib import Path

import pytest

from support.cli import invoke, signalled_once
from support.recipes import write_recipe
from support.rows import write_jsonl
from support.runs import assert_same_run, losses, read_metrics

DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"


def date_rows(count: int) -> list[dict]:
    """The first `count` date rows of the real demo's train file (chat rows, ~85 tokens with the system prompt
    the template adds)."""
    rows = [json.loads(line) for line in (DATA / "iso-dates-train.jsonl").open()]
    return [row for row in rows if "YYYY-MM-DD" in row["messages"][0]["content"]][:count]


def real_recipe(tmp_path: Path, model: Path, rows: int, **sections) -> Path:
    """A chat recipe on the real model and `rows` date rows; keyword sections merged over conftest's defaults."""
    data = write_jsonl(tmp_path / "dates.jsonl", date_rows(rows))
    return write_recipe(tmp_path / "recipe.yaml", model, data, **{
        "data": {"path": str(data), "format": "chat", "max_length": 96, "sampler": "random"},
        "peft": {"rank": 8}, **sections})


def verified_gap(output: str) -> float:
    """The max |logit difference| `merge-lora --verify` printed."""
    return float(re.search(r"as trained = (\S+)", output).group(1))


def test_resume_after_sigkill_mid_epoch_is_bitwise_the_uninterrupted_run(real_model_dir, tmp_path, monkeypatch):
    # 4 rows, one a step: 4 steps an epoch. A checkpoint at step 3 (mid-epoch), the kill after it, and the
    # resumed run crosses into the second epoch (a new shuffle) with dropout on: the sampler's and every RNG's
    # state must come back exactly.
    recipe = real_recipe(tmp_path, real_model_dir, 4, peft={"rank": 8, "dropout": 0.1},
                         training={"micro_batch_size": 1, "max_steps": 5, "learning_rate": 1e-3},
                         checkpoint={"every_steps": 3})
    straight = tmp_path / "straight"
    result = invoke("train", recipe, "--output-dir", straight, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output

    run = tmp_path / "killed"
    # the checkpoint is published by a rename once committed; the kill comes before step 5 ends
    killed = signalled_once([sys.executable, "-m", "gpupoor", "train", recipe, "--output-dir", run],
                            lambda: (run / "checkpoints" / "step-000003").is_dir(), signal.SIGKILL, poll_s=0.02)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (run / "final").exists() and losses(run)[-1][0] < 5, losses(run)

    resumed = invoke("resume", run, monkeypatch=monkeypatch)  # in this process: only the kill needs its own
    assert resumed.exit_code == 0, resumed.output
    assert "resuming from step-000003" in resumed.stdout, resumed.stdout
    assert [step for step, _ in losses(run)] == list(range(1, 6))  # the steps after the kill redone once each
    assert_same_run(straight, run)  # every step's loss and the final adapter, bitwise


def test_qlora_nf4_double_quant_trains_and_merges(real_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    recipe = real_recipe(tmp_path, real_model_dir, 2,
                         quantization={"bits": 4, "quant_type": "nf4", "double_quant": True},
                         training={"micro_batch_size": 2, "max_steps": 3, "learning_rate": 2e-3})
    run = tmp_path / "run"
    result = invoke("train", recipe, "--output-dir", run)
    assert result.exit_code == 0, result.output
    assert "base quantized to 4-bit nf4 with double quant;" in result.output, result.output
    # The base really is 4-bit: its weights take well under half of fp32's 4 bytes a parameter.
    said = re.search(r"parameters ([\d,]+);.* weights ([\d.]+) MiB", result.output)
    assert float(said.group(2)) * 2**20 < 0.4 * 4 * int(said.group(1).replace(",", "")), result.output
    steps = losses(run)
    assert len(steps) == 3 and all(math.isfinite(loss) for _, loss in steps)
    assert steps[-1][1] < 0.8 * steps[0][1], steps  # the same 2 rows every step: the loss must fall
    # Merged into the dequantized 4-bit base (merge-lora's default for QLoRA), the model is the one that trained.
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged", "--verify")
    assert merged.exit_code == 0, merged.output
    assert verified_gap(merged.output) < 1e-3, merged.output


def test_dora_trains_and_merges_into_the_directory_base(real_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = real_recipe(tmp_path, real_model_dir, 2, peft={"method": "dora", "rank": 8},
                         training={"micro_batch_size": 2, "max_steps": 3, "learning_rate": 2e-3})
    run = tmp_path / "run"
    result = invoke("train", recipe, "--output-dir", run)
    assert result.exit_code == 0, result.output
    steps = losses(run)
    assert len(steps) == 3 and steps[-1][1] < 0.8 * steps[0][1], steps
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged", "--verify")
    assert merged.exit_code == 0, merged.output
    assert verified_gap(merged.output) < 1e-3, merged.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers, no peft
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 30


def test_dpo_on_real_preference_pairs_prefers_the_iso_answer(real_model_dir, tmp_path):
    # The 12 shipped pairs (the ISO date chosen; a wordy answer or a wrong date rejected), 2 a step. At step 1 the
    # policy is its reference (the new adapter adds zero): loss ln 2, margin 0. Two steps later it prefers the
    # chosen answers of pairs it has not trained on yet: the loss below ln 2 and the margin positive.
    pairs = DATA / "iso-dates-pairs.jsonl"
    recipe = write_recipe(tmp_path / "dpo.yaml", real_model_dir, pairs,
                          data={"path": str(pairs), "format": "preference", "max_length": 96, "sampler": "random"},
                          peft={"rank": 8}, preference={"beta": 0.5},
                          training={"objective": "dpo", "micro_batch_size": 2, "max_steps": 3, "learning_rate": 2e-3})
    run = tmp_path / "run"
    result = invoke("train", recipe, "--output-dir", run)
    assert result.exit_code == 0, result.output
    steps = [record for record in read_metrics(run) if "loss" in record]
    assert len(steps) == 3
    first, last = steps[0], steps[-1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and abs(first["rewards/margins"]) < 1e-3, first
    assert last["loss"] < math.log(2) - 0.05 and last["rewards/margins"] > 0, steps
    assert last["rewards/accuracies"] > 0.5, steps
