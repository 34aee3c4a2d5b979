"""Every training method (#14): LoRA, DoRA, IA3, full fine-tuning, the last N layers: each trains, resumes
bitwise, and leaves outputs plain peft/transformers load; frozen layers stay frozen and keep no activations."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from support.cli import invoke
from support.recipes import PEFT_METHODS
from support.runs import read_metrics
from support.methods import METHODS, final_tensors


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


PROBE = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7, 11, 90]])


@pytest.mark.parametrize("name", ["dora", "ia3", "full"])
def test_outputs_load_without_gpupoor(name, make_recipe, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    recipe = make_recipe(peft={"rank": 4, **METHODS[name]}, training={"max_steps": 3, "learning_rate": 2e-2})
    assert invoke("train", recipe, "--output-dir", run).exit_code == 0
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    if name == "full":
        trained = AutoModelForCausalLM.from_pretrained(run / "final").eval()  # a standard model directory
    else:
        from peft import PeftModel

        trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), run / "final").eval()
    difference = (_logits(trained, PROBE) - _logits(base, PROBE)).abs().max()
    assert difference > 1e-4  # it trained: the output is not the base's


def test_full_with_last_layer_keeps_the_frozen_weights_bitwise(make_recipe, tiny_model, tmp_path):
    run = tmp_path / "run"
    recipe = make_recipe(peft=METHODS["full-last-layer-and-head"], training={"max_steps": 3, "learning_rate": 2e-2})
    result = invoke("train", recipe, "--output-dir", run)
    assert result.exit_code == 0, result.output
    base, trained = load_file(tiny_model / "model.safetensors"), final_tensors(run)
    changed = {name for name in base if not torch.equal(base[name], trained[name])}
    assert changed and all(name.startswith(("model.layers.1.", "lm_head.")) for name in changed), sorted(changed)
    assert any(name.startswith("model.layers.1.") for name in changed) and "lm_head.weight" in changed
    assert "method full on the last 1 decoder layers and lm_head" in result.output


def test_a_full_checkpoint_with_a_corrupt_shard_is_skipped(make_recipe, tmp_path, monkeypatch):
    run = tmp_path / "run"
    recipe = make_recipe(peft={"method": "full"}, training={"max_steps": 6}, checkpoint={"every_steps": 2})
    assert invoke("train", recipe, "--output-dir", run, monkeypatch=monkeypatch, fault="sigterm@5").exit_code == 75
    shard = run / "checkpoints" / "step-000005" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[int(len(data) * 0.9)] ^= 1
    shard.write_bytes(bytes(data))
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert "skipping checkpoint step-000005: model.safetensors is corrupt" in result.output


def test_last_layers_beyond_the_model_is_a_clear_error(make_recipe, tmp_path):
    result = invoke("train", make_recipe(peft={"last_layers": 5}), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and "peft.last_layers = 5 but the model has 2 decoder layers" in result.output


def test_generate_and_merge_on_a_full_run(make_recipe, tmp_path):
    run = tmp_path / "run"
    assert invoke("train", make_recipe(peft={"method": "full"}, training={"max_steps": 2}), "--output-dir", run).exit_code == 0
    generated = invoke("generate", run, "--prompt", "sort lists", "--max-new-tokens", "3")
    assert generated.exit_code == 0, generated.output
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged")
    assert merged.exit_code == 2 and "holds a whole fine-tuned model" in merged.output
    status = invoke("status", run)
    assert status.exit_code == 0 and "finished: the model is in final/ (verified" in status.output, status.output


def test_ia3_on_the_last_layer_and_full_on_a_tied_head(make_recipe, tiny_tied_model, tmp_path):
    ia3 = invoke("train", make_recipe("ia3.yaml", peft={"method": "ia3", "last_layers": 1}, training={"max_steps": 2}),
                 "--output-dir", tmp_path / "ia3")
    assert ia3.exit_code == 0, ia3.output
    scaled = [k for k in load_file(tmp_path / "ia3" / "final" / "adapter_model.safetensors") if "ia3_l" in k]
    assert scaled and all(".layers.1." in k for k in scaled)
    # A head tied to the embeddings: naming lm_head trains the shared weight.
    head = invoke("train", make_recipe("head.yaml", model={"name_or_path": str(tiny_tied_model)},
                                       peft={"method": "full", "modules_to_save": ["lm_head"]},
                                       training={"max_steps": 2}), "--output-dir", tmp_path / "head")
    assert head.exit_code == 0, head.output
    base = load_file(tiny_tied_model / "model.safetensors")
    trained = final_tensors(tmp_path / "head")
    changed = sorted(k for k in base if not torch.equal(base[k], trained[k]))
    assert changed == ["model.embed_tokens.weight"], changed
