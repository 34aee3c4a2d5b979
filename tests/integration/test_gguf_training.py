"""Training from a GGUF base (issue #27): the tiny Llama written as a GGUF trains like its directory does, resumes
exactly, says what it was dequantized from, and merge-lora writes an ordinary transformers directory."""

from __future__ import annotations

import re

import pytest
import torch

from support.cli import invoke
from support.recipes import write_recipe
from support.runs import read_metrics

STEPS = {"training": {"max_steps": 2, "micro_batch_size": 4, "learning_rate": 1e-2, "cpu_threads": 1,
                      "warmup_steps": 0}}


def losses(run):
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory, tiny_gguf):
    """Two steps of LoRA from the GGUF base, trained once for the module."""
    from support.rows import alpaca_rows, write_jsonl

    root = tmp_path_factory.mktemp("gguf-run")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(48))
    recipe = write_recipe(root / "r.yaml", tiny_gguf, data, **STEPS)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("GPUPOOR_CACHE", str(root / "cache"))
        result = invoke("train", recipe, "--output-dir", root / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    return recipe, root / "run", result.output


def test_trains_like_its_directory_and_says_what_it_was_dequantized_from(gguf_run, tiny_model, tiny_gguf, tmp_path,
                                                                          monkeypatch):
    recipe, run, output = gguf_run
    assert "(GGUF, dequantized from F32 to fp32)" in output, output
    card = (run / "final" / "README.md").read_text()  # loads the base as transformers can: by gguf_file=
    assert f'from_pretrained("{tiny_gguf.parent}", gguf_file="{tiny_gguf.name}")' in card
    # The same model and tokenizer as the directory it was written from: the same losses.
    from support.rows import alpaca_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(48))
    plain = write_recipe(tmp_path / "plain.yaml", tiny_model, data, **STEPS)
    result = invoke("train", plain, "--output-dir", tmp_path / "plain", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    ours, theirs = losses(run), losses(tmp_path / "plain")
    assert [step for step, _ in ours] == [step for step, _ in theirs] == [1, 2]
    assert [loss for _, loss in ours] == pytest.approx([loss for _, loss in theirs], rel=1e-5)


def test_resume_from_a_gguf_base_is_exact_and_notices_a_replaced_file(gguf_run, tiny_gguf, tmp_path, monkeypatch):
    import shutil

    _, reference, _ = gguf_run
    base = tmp_path / "base.gguf"
    shutil.copy(tiny_gguf, base)
    from support.rows import alpaca_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(48))
    recipe = write_recipe(tmp_path / "r.yaml", base, data, **STEPS)
    run = tmp_path / "run"
    result = invoke("train", recipe, "--output-dir", run, fault="sigterm@1", monkeypatch=monkeypatch)
    assert result.exit_code == 75, result.output
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert losses(run) == losses(reference)  # bitwise
    # A file replaced at the same path is another base: the resume refuses it.
    (run / "final").rename(tmp_path / "final-aside")
    data = bytearray(base.read_bytes())
    data[-1] ^= 1
    base.write_bytes(bytes(data))
    extended = invoke("resume", run, "--set", "training.max_steps=3", monkeypatch=monkeypatch)
    assert extended.exit_code == 2 and "base.gguf changed" in extended.output, extended.output


def test_merge_lora_writes_a_transformers_directory(gguf_run, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run, _ = gguf_run
    result = invoke("merge-lora", run, "--output", tmp_path / "merged", "--verify")
    assert result.exit_code == 0, result.output
    # --verify loads base + adapter from the GGUF itself (the real tier checks its merge against the directory)
    assert float(re.search(r"as trained = (\S+)", result.output).group(1)) < 1e-5, result.output
    assert not list(tmp_path.glob(".tmp-*")), "the dequantized base was left behind"
    merged_dir = tmp_path / "merged"
    assert (merged_dir / "config.json").is_file() and list(merged_dir.glob("*.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)  # plain transformers: no gguf_file, no gpupoor
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert tokenizer.chat_template  # the GGUF's own
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), run / "final")
    probe = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7]])
    with torch.no_grad():
        assert torch.allclose(merged(probe).logits, trained(probe).logits, atol=1e-5)


def test_qlora_on_a_dequantized_gguf_base_trains_and_merges(tiny_gguf, tmp_path, monkeypatch):
    from support.rows import alpaca_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(16))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_gguf, data, quantization={"bits": 4},
                          training={**STEPS["training"], "max_steps": 1})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    # The summary names both steps: the GGUF dequantized, then quantized again for QLoRA.
    assert "dequantized from" in result.output, result.output
    assert "base quantized to 4-bit nf4 with double quant;" in result.output, result.output
    result = invoke("merge-lora", tmp_path / "run", "--output", tmp_path / "merged")
    assert result.exit_code == 0 and "4-bit, dequantized" in result.output, result.output


def test_train_on_a_truncated_gguf_exits_2_and_writes_nothing(tiny_gguf, tmp_path, monkeypatch):
    from support.rows import alpaca_rows, write_jsonl

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-100])  # the last tensor's end missing
    recipe = write_recipe(tmp_path / "r.yaml", cut, write_jsonl(tmp_path / "t.jsonl", alpaca_rows(8)), **STEPS)
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 2 and str(cut) in result.output and "truncated" in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_generate_on_a_run_from_a_gguf_base_says_what_its_merge_says(gguf_run, tmp_path, monkeypatch):
    _, run, _ = gguf_run
    args = ["--prompt", "sort the lists", "--max-new-tokens", "8"]
    adapter = invoke("generate", run, *args, monkeypatch=monkeypatch)  # the base is the .gguf the run names
    assert adapter.exit_code == 0, adapter.output
    assert invoke("merge-lora", run, "--output", tmp_path / "merged", monkeypatch=monkeypatch).exit_code == 0
    merged = invoke("generate", tmp_path / "merged", "--format", "alpaca", *args, monkeypatch=monkeypatch)
    assert merged.exit_code == 0, merged.output
    assert adapter.output.strip() and merged.output == adapter.output
