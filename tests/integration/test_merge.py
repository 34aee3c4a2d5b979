"""merge-lora (streaming, QLoRA-aware) and generate, against peft's own merge and plain transformers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from support.rows import alpaca_rows, write_jsonl
from gpupoor.cli import app
from support.merge import (assert_merges_as_trained_only_into_the_dequantized_base, lora_run, merge, runner, train_run,
                           workdir)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


PROBE = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7, 11, 90]])


def test_merge_equals_peft_merge_and_unload(lora_run, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = merge(lora_run, "--output", tmp_path / "merged")
    assert result.exit_code == 0, result.output
    assert re.search(r"^merging: (\d+)/\1 tensors, \d+s$", result.output, re.M), result.output  # progress, last line
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), lora_run / "final")
    with_adapter = logits(reference, PROBE)
    reference = reference.merge_and_unload()
    ours, theirs, original = merged.state_dict(), reference.state_dict(), base.state_dict()
    assert ours.keys() == theirs.keys()
    changed = 0
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6, rtol=0), name
        changed += not torch.equal(ours[name], original[name])
    assert changed >= 14  # every adapted linear layer of both blocks moved: B is not zero
    assert torch.allclose(logits(merged, PROBE), with_adapter, atol=1e-5)
    assert not torch.allclose(logits(merged, PROBE), logits(base, PROBE), atol=1e-3)


def test_sharded_base_in_and_out(lora_run, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded-base"
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(sharded, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_model / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert merge(lora_run, "--output", tmp_path / "a", "--base", sharded).exit_code == 0
    assert merge(lora_run, "--output", tmp_path / "b", "--max-shard-size", "30KB").exit_code == 0
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_trained_head_on_tied_embeddings_is_untied(workdir, tiny_tied_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = train_run(workdir, tiny_tied_model, "tied", peft={"modules_to_save": ["lm_head"]})
    assert merge(run, "--output", tmp_path / "m").exit_code == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert merged.config.tie_word_embeddings is False
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_tied_model), run / "final")
    assert torch.allclose(logits(merged, PROBE), logits(trained.eval(), PROBE), atol=1e-5)


def test_qlora_merge_reproduces_the_trained_model(workdir, tiny_model, tmp_path):
    pytest.importorskip("bitsandbytes")
    run = train_run(workdir, tiny_model, "qlora", quantization={"bits": 4})
    assert_merges_as_trained_only_into_the_dequantized_base(run, tmp_path)


def test_run_without_final_adapter_names_the_checkpoints(workdir, tiny_model, tmp_path):
    run = train_run(workdir, tiny_model, "unfinished", checkpoint={"every_steps": 2})
    (run / "final" / "adapter_config.json").unlink()
    result = merge(run, "--output", tmp_path / "m")
    assert result.exit_code == 2 and "no trained weights at final" in result.output and "step-000006" in result.output
    assert merge(run, "--output", tmp_path / "m", "--checkpoint", "step-000004").exit_code == 0


@pytest.mark.parametrize("size", ["0", "0.4"])
def test_max_shard_size_below_one_byte_is_refused(lora_run, tmp_path, size):
    result = merge(lora_run, "--output", tmp_path / "m", "--max-shard-size", size)
    assert result.exit_code == 2, result.output
    assert f"--max-shard-size '{size}': a shard must hold at least 1 byte" in result.output
    assert not (tmp_path / "m").exists()


def test_checkpoint_outside_the_run_directory_is_refused(lora_run, tmp_path):
    import shutil

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(lora_run / "final", elsewhere)
    for value in (str(elsewhere), "../../elsewhere", "../final"):  # a path, even one back into the run, is no name
        result = merge(lora_run, "--output", tmp_path / "m", "--checkpoint", value)
        assert result.exit_code == 2 and f"--checkpoint '{value}': use final or the name step-N" in result.output, \
            result.output
        generated = runner.invoke(app, ["generate", str(lora_run), "--checkpoint", value, "--prompt", "sort"])
        assert generated.exit_code == 2 and "not a path" in generated.output, generated.output
    assert not (tmp_path / "m").exists()


def test_checkpoint_with_an_adapter_directory_is_refused(lora_run, tmp_path):
    result = merge(lora_run / "final", "--output", tmp_path / "m", "--checkpoint", "step-000002")
    assert result.exit_code == 2 and "is not a run directory, so it has no checkpoints" in result.output
    generated = runner.invoke(app, ["generate", str(lora_run / "final"), "--checkpoint", "step-000002",
                                    "--prompt", "sort"])
    assert generated.exit_code == 2 and "is not a run directory" in generated.output, generated.output
    assert not (tmp_path / "m").exists()


def test_base_with_other_shapes_is_refused(lora_run, tokenizer, tmp_path):
    from gpupoor.model.tiny import build_tiny_llama

    wider = build_tiny_llama(tmp_path / "wider", tokenizer, hidden=48, layers=2, heads=4, kv_heads=2)
    result = merge(lora_run, "--output", tmp_path / "m", "--base", wider)
    assert result.exit_code == 2 and "trained on another model" in result.output and "--base" in result.output
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".tmp-*"))


def test_base_of_another_architecture_is_refused(lora_run, tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4)).save_pretrained(gpt2)
    result = merge(lora_run, "--output", tmp_path / "m", "--base", gpt2)
    assert result.exit_code == 2 and "another architecture" in result.output


def test_existing_output_is_refused(lora_run, tmp_path):
    (tmp_path / "m").mkdir()
    result = merge(lora_run, "--output", tmp_path / "m")
    assert result.exit_code == 2 and "already exists" in result.output


@pytest.mark.parametrize("stop, code", [("ctrl-c", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_interrupted_merge_leaves_no_output(lora_run, tmp_path, monkeypatch, stop, code):
    """Ctrl-C, or a real SIGTERM / SIGHUP sent mid-merge: the partial output removed, the shell's code for each. The
    test's own handler only records a signal: without merge-lora's handling the merge would finish (exit 0)."""
    import os
    import signal

    import gpupoor.storage.shards as merge_module

    calls, received = [], []

    def failing_add(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), getattr(signal, stop))
        return original(self, name, tensor)

    original = merge_module.ShardWriter.add
    monkeypatch.setattr(merge_module.ShardWriter, "add", failing_add)
    signum = getattr(signal, stop, signal.SIGTERM)
    previous = signal.signal(signum, lambda *args: received.append(args[0]))
    try:
        result = merge(lora_run, "--output", tmp_path / "m", "--max-shard-size", "10KB")
    finally:
        signal.signal(signum, previous)
    assert result.exit_code == code, result.output
    assert not received and not (tmp_path / "m").exists() and not list(tmp_path.glob(".tmp-*"))
    if stop != "ctrl-c":
        assert f"stopped by {stop}" in result.output


def test_generate_is_greedy_and_uses_the_run_format(lora_run, tmp_path):
    args = ["generate", str(lora_run), "--prompt", "sort the lists", "--max-new-tokens", "8"]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert first.output == second.output and first.output.strip()
    # The merged model, prompted in the same (alpaca) format, says the same thing.
    assert merge(lora_run, "--output", tmp_path / "merged").exit_code == 0
    merged = runner.invoke(app, ["generate", str(tmp_path / "merged"), "--format", "alpaca", "--prompt",
                                 "sort the lists", "--max-new-tokens", "8"])
    assert merged.exit_code == 0, merged.output
    assert merged.output == first.output


def test_generate_from_a_prompt_file(lora_run, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"instruction": "sort", "input": "lists"}, {"prompt": "reverse"}])
    result = runner.invoke(app, ["generate", str(lora_run), "--file", str(prompts), "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line["instruction"] for line in lines] == ["sort", "reverse"] and all("completion" in l for l in lines)


def test_generate_needs_exactly_one_prompt_source(lora_run, tmp_path):
    result = runner.invoke(app, ["generate", str(lora_run)])  # nothing piped in either
    assert result.exit_code == 2 and "--prompt" in result.output
    both = runner.invoke(app, ["generate", str(lora_run), "--prompt", "x", "--file", str(tmp_path / "p.jsonl")])
    assert both.exit_code == 2 and "not both" in both.output


def test_generate_reads_piped_prompts_one_per_line_or_as_rows(lora_run):
    plain = runner.invoke(app, ["generate", str(lora_run), "--max-new-tokens", "4"], input="first prompt\n\nsecond\n")
    assert plain.exit_code == 0, plain.output
    answers = [json.loads(line) for line in plain.stdout.splitlines() if line.startswith("{")]
    assert [a["instruction"] for a in answers] == ["first prompt", "second"]
    rows = '{"instruction": "Reverse the letters.", "input": "a b c"}\n'
    piped = runner.invoke(app, ["generate", str(lora_run), "--input", "-", "--max-new-tokens", "4"], input=rows)
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.stdout.splitlines()[-1])["input"] == "a b c"


def test_an_empty_answer_says_why():
    from gpupoor.model.generation import complete

    class EndsAtOnce(torch.nn.Module):
        def __init__(self, tokens: list[int]):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.tokens = tokens

        def generate(self, input_ids, **kwargs):
            return torch.cat([input_ids, torch.tensor([self.tokens] * len(input_ids))], dim=1)

    class Tokenizer:
        pad_token_id, eos_token_id = 0, 2

        def batch_decode(self, rows, skip_special_tokens):
            return ["" if all(t in (0, 2) for t in row.tolist()) else "text" for row in rows]

    reasons: list = []
    assert complete(EndsAtOnce([2, 0, 0]), Tokenizer(), [[5, 6]], 3, reasons=reasons) == [""]
    assert "first token was end-of-sequence" in reasons[0]
    reasons = []
    complete(EndsAtOnce([0, 0, 0]), Tokenizer(), [[5, 6]], 3, reasons=reasons)
    assert "special or blank" in reasons[0]
    reasons = []
    assert complete(EndsAtOnce([7, 2, 0]), Tokenizer(), [[5, 6]], 3, reasons=reasons) == ["text"]
    assert reasons == [None]
