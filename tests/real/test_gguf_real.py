"""The real GGUF (SmolLM2-135M-Instruct, Q4_1) as a base: its architecture read from the metadata alone, and its
weights and tokenizer loaded through transformers' GGUF support, dequantized."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from gpupoor.cli import app


def write_recipe(tmp_path, model):
    """A small alpaca recipe on `model` (tests/conftest.py's helpers are shadowed here by this tier's conftest)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {n}.", "output": str(n)}) + "\n" for n in range(8)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name_or_path": str(model)},
                                      "data": {"path": str(data), "format": "alpaca", "max_length": 64},
                                      "training": {"max_steps": 1, "micro_batch_size": 2}}))
    return recipe


def test_validate_and_plan_read_smollm2_from_its_metadata(real_gguf, tmp_path, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("validate/plan loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    recipe = write_recipe(tmp_path, real_gguf)
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 0, result.output
    from gpupoor.model.shape import load_shape
    from gpupoor.recipe.loading import load_recipe

    shape, source = load_shape(load_recipe(recipe))
    assert source == str(real_gguf)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.vocab, shape.tied) == \
        (30, 576, 9, 3, 49152, True)
    assert shape.total_params == pytest.approx(134.5e6, rel=0.01)


def test_smollm2_tokenizer_and_chat_template_come_from_the_gguf(real_gguf):
    # (its weights, dequantized by the same loader, are checked by the one real rebuild in test_dequantized_copy.py:
    # byte for byte the cached copy, and the model answers "Paris")
    from gpupoor.model.gguf import read_gguf
    from gpupoor.model.load import load_tokenizer
    from gpupoor.recipe.schema import ModelSection

    assert read_gguf(real_gguf).quantization == "Q4_1, Q8_0"
    tokenizer = load_tokenizer(str(real_gguf), ModelSection(name_or_path=str(real_gguf)))
    assert len(tokenizer) == 49152 and "<|im_start|>" in tokenizer.chat_template
    ids = tokenizer("The capital of France is").input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The capital of France is"


def test_train_from_smollm2_gguf_and_merge_into_a_transformers_directory(real_gguf, real_model_dir, tmp_path,
                                                                         monkeypatch):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("GPUPOOR_CACHE", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path, real_gguf)
    result = CliRunner().invoke(app, ["train", str(recipe), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "(GGUF, dequantized from Q4_1, Q8_0 to fp32)" in result.output
    # Merged onto the dequantized directory (--base): a GGUF base is merged by dequantizing it with
    # save_dequantized into a temporary directory first, the very function that wrote the dequantized directory
    # (byte for byte the GGUF's: test_dequantized_copy.py), so the bytes merged are the same without half a minute
    # more of dequantizing. merge-lora's own GGUF branch runs on the tiny GGUF in test_gguf_training.py.
    result = CliRunner().invoke(app, ["merge-lora", str(tmp_path / "run"), "--output", str(tmp_path / "merged"),
                                      "--base", str(real_model_dir)])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers, no GGUF
    assert merged.config.tie_word_embeddings and merged.config.num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert "<|im_start|>" in tokenizer.chat_template
    # The merged model is the one that trained: base + adapter, the base read from the dequantized directory (the
    # GGUF's own dequantization, byte for byte: test_dequantized_copy.py) rather than from the GGUF again, as
    # `merge-lora --verify` would (its GGUF path runs on the tiny GGUF in tests/integration/test_gguf_training.py).
    base = AutoModelForCausalLM.from_pretrained(real_model_dir)
    trained = PeftModel.from_pretrained(base, tmp_path / "run" / "final").eval()
    probe = tokenizer(["The capital of France is", "Say 3."], return_tensors="pt", padding=True)
    mask = probe["attention_mask"].bool()
    with torch.no_grad():
        reference, logits = trained(**probe).logits[mask], merged.eval()(**probe).logits[mask]
        with trained.disable_adapter():
            untrained = trained(**probe).logits[mask]
    gap, moved = float((reference - logits).abs().max()), float((reference - untrained).abs().max())
    assert gap < 1e-3 and moved > 10 * gap, (gap, moved)  # and the adapter it merged did change the model
