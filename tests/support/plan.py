"""Shared by the plan tests (moved from unit/plan/test_plan.py, whose tests still use them)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import gpupoor.plan.make as plan_make
from gpupoor.plan.settings import resolve_settings
from gpupoor.model.shape import LINEARS, Shape
from gpupoor.recipe.schema import Recipe
from gpupoor.units import MiB


runner = CliRunner()


LLAMA = dict(hidden=64, intermediate=176, heads=4, kv_heads=2)


def tiny_llama_with(method="lora", layers=2, rank=8, dropout=0.0, attention="sdpa", targets="all-linear",
                    autocast_bf16=False, checkpointing=False, last_layers=None, modules_to_save=(), fused=True):
    """A random-weight Llama of LLAMA's dimensions with `method` applied the way peft and transformers do it:
    LoRA/DoRA/IA3 through peft (on the last `last_layers` layers), full by requires_grad on the chosen
    parameters; trainable tensors in fp32 and input grads off, as gpupoor trains; the fused layers installed
    unless not `fused` (model.fused_layers). Returns (model, decoder)."""
    from gpupoor.model.fast_paths import apply_fast_paths
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=LLAMA["hidden"], intermediate_size=LLAMA["intermediate"],
                         num_hidden_layers=layers, num_attention_heads=LLAMA["heads"],
                         num_key_value_heads=LLAMA["kv_heads"], use_cache=False)
    dtype = torch.bfloat16 if autocast_bf16 else torch.float32
    model = LlamaForCausalLM._from_config(config, attn_implementation=attention, dtype=dtype)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # transformers (here) and peft (below) each hook the embedding to make its output require grad, each
        # forgetting the other's hook: without both removed, frozen layers below keep their inputs.
        model.disable_input_require_grads()
    model = apply_method_like_peft(model, method, rank=rank, dropout=dropout, targets=targets,
                                   last_layers=last_layers, modules_to_save=modules_to_save)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    causal_lm.disable_input_require_grads()  # frozen layers below the trained ones need no input gradient
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    apply_fast_paths(model, fused, method=method, dropout=dropout, precision="bf16" if autocast_bf16 else "fp32")
    model.train()
    return model, causal_lm.model


def apply_method_like_peft(model, method, rank=4, dropout=0.0, targets="all-linear", last_layers=None,
                           modules_to_save=()):
    """`method` on a transformers Llama as the libraries do it, independently of gpupoor.model.build."""
    from peft import IA3Config, LoraConfig, get_peft_model

    layers = model.config.num_hidden_layers
    where = ({"layers_to_transform": list(range(layers - last_layers, layers)), "layers_pattern": "layers"}
             if last_layers else {})
    saved = list(modules_to_save) or None
    if last_layers and targets == "all-linear":  # peft takes layers_to_transform with a list of names only
        targets = list(LINEARS)
    if method in ("lora", "dora"):
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                                                target_modules=targets, use_dora=method == "dora",
                                                modules_to_save=saved, **where))
    if method == "ia3":  # IA3Config has no layers_to_transform: the layers' modules by name
        scaled, feedforward = ["self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"], ["mlp.down_proj"]
        if last_layers:
            chosen = range(layers - last_layers, layers)
            scaled = [f"layers.{j}.{name}" for j in chosen for name in scaled]
            feedforward = [f"layers.{j}.{name}" for j in chosen for name in feedforward]
        return get_peft_model(model, IA3Config(target_modules=scaled, feedforward_modules=feedforward,
                                               modules_to_save=saved))
    chosen = [f"model.layers.{j}." for j in range(layers - (last_layers or 0), layers)] if last_layers else []
    for name, param in model.named_parameters():
        everything = not last_layers and not modules_to_save
        param.requires_grad = (everything or name.startswith(tuple(chosen))
                               or any(f".{m}." in f".{name}" for m in modules_to_save))
    return model


def tiny_shape(layers=2) -> Shape:
    return Shape("llama", LLAMA["hidden"], LLAMA["intermediate"], layers, LLAMA["heads"],
                          LLAMA["kv_heads"], LLAMA["hidden"] // LLAMA["heads"], 300, False, False)


def tiny_settings(layers=2, seq=64, batch=2, precision="fp32", attention="sdpa", checkpointing=False, fused=True,
                  **peft):
    """The plan's settings for a recipe on the LLAMA shape; length-grouped batches carry no mask, like the
    measured forwards."""
    shape = tiny_shape(layers)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x", "attention": attention, "fused_layers": fused},
                                    "data": {"path": "x.jsonl", "max_length": seq, "sampler": "length_grouped"},
                                    "peft": peft,
                                    "precision": precision, "training": {"micro_batch_size": batch},
                                    "memory": {"gradient_checkpointing": checkpointing}})
    return shape, resolve_settings(recipe, "cpu", shape)


@pytest.fixture
def small_gpu(monkeypatch):
    """Make the preflight believe it runs on a CUDA GPU with 64 MiB free."""
    monkeypatch.setattr(plan_make, "default_device", lambda recipe: "cuda")
    monkeypatch.setattr(plan_make, "device_memory", lambda device: (64 * MiB, "test GPU"))
