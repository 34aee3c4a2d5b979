"""The memory stack: fused chunked cross-entropy, activation checkpointing, optimizers and their resume."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import gpupoor.decisions as decisions
from support.batches import masked_batch
from support.runs import read_metrics
from gpupoor.cli import app
from gpupoor.objectives.cross_entropy import find_fused_head, fused_loss_sum, linear_cross_entropy_sum, plain_loss_sum
from support.memory import runner


@pytest.mark.parametrize("weight_grad", [False, True])
def test_linear_cross_entropy_matches_the_plain_loss(monkeypatch, weight_grad):
    monkeypatch.setattr(decisions, "CHUNK_ELEMENTS", 7 * 50)  # 7 tokens per chunk: many chunks, a ragged last
    monkeypatch.setattr(decisions, "MIN_CHUNK_TOKENS", 1)
    torch.manual_seed(0)
    hidden = torch.randn(45, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=weight_grad)
    targets = torch.randint(0, 50, (45,))
    ours = linear_cross_entropy_sum(hidden, weight, targets)
    (ours * 0.5).backward()  # an upstream scale, as the loop applies 1 / target tokens
    grads = (hidden.grad.clone(), weight.grad.clone() if weight_grad else None)
    hidden.grad = None
    weight.grad = None
    plain = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    (plain * 0.5).backward()
    assert torch.allclose(ours, plain, rtol=1e-12, atol=0)
    assert torch.allclose(grads[0], hidden.grad, rtol=1e-10, atol=1e-12)
    if weight_grad:
        assert torch.allclose(grads[1], weight.grad, rtol=1e-10, atol=1e-12)


def _peft(model_dir, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, **lora))
    return model.train()


def _loss_and_grads(model, batch, fused: bool):
    model.zero_grad(set_to_none=True)
    if fused:
        head, why = find_fused_head(model)
        assert head is not None, why
        loss = fused_loss_sum(model, batch, head)
    else:
        loss = plain_loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", ["lora", "trained_head", "tied_embeddings"])
def test_fused_loss_equals_plain_loss_on_a_model(case, tiny_model, tiny_tied_model, tokenizer):
    model_dir = tiny_tied_model if case == "tied_embeddings" else tiny_model
    extra = {"modules_to_save": ["lm_head"]} if case == "trained_head" else {}
    # float64, so the comparison does not hinge on float32 rounding (which differs between CPUs and BLAS
    # builds). The fused loss then runs in float64; the plain loss still casts the logits to float32, so the
    # two differ by a few float32 epsilons (measured: 3e-8 of the loss, 2e-7 of a gradient's norm), while a
    # token counted wrongly or a missed gradient path is off by percents.
    model = _peft(model_dir, **extra).double()
    batch = masked_batch(tokenizer)
    plain_loss, plain_grads = _loss_and_grads(model, batch, fused=False)
    fused_loss, fused_grads = _loss_and_grads(model, batch, fused=True)
    assert abs(float(fused_loss - plain_loss)) <= 1e-5 * abs(float(plain_loss))
    if case == "trained_head":
        assert any("lm_head" in name for name in fused_grads)
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert fused_grads[name].dtype == torch.float64, name
        assert (fused_grads[name] - grad).norm() <= 1e-5 * grad.norm(), name


@pytest.mark.parametrize("case", ["lora", "trained_head"])
def test_the_fused_loss_gives_the_head_a_contiguous_input(case, tiny_model, tokenizer):
    """The model still computes one position's logits from a slice of the hidden states; on a CPU a bf16 linear
    of a non-contiguous 3-D slice copies the head weight once per row (0.44 s a step at SmolLM2's head, measured
    on an Intel Xeon with AMX): the fused loss hands the head that slice contiguous, and removes its hook."""
    model = _peft(tiny_model, **({"modules_to_save": ["lm_head"]} if case == "trained_head" else {}))
    head, why = find_fused_head(model)
    assert head is not None, why
    seen = []
    # a forward hook sees the input as the forward got it, after every pre-hook
    probe = head.head.register_forward_hook(lambda module, args, out: seen.append(args[0].is_contiguous()))
    try:
        fused_loss_sum(model, masked_batch(tokenizer), head)
    finally:
        probe.remove()
    assert seen == [True]
    assert not head.head._forward_pre_hooks and not head.decoder._forward_hooks  # nothing left behind


def test_fused_loss_falls_back_when_the_head_is_adapted(tiny_model):
    model = _peft(tiny_model, exclude_modules=None)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapted_head = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                  LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert find_fused_head(model)[0] is not None
    head, why = find_fused_head(adapted_head)
    assert head is None and "adapted" in why


@pytest.mark.parametrize("mode", [True, "offload"])
def test_activation_checkpointing_gives_bitwise_equal_lora_gradients(tiny_model, tokenizer, mode):
    from gpupoor.model.build import build_model
    from gpupoor.recipe.schema import MemorySection, ModelSection, PeftSection, QuantizationSection

    def grads(checkpointing):
        model = build_model(str(tiny_model), ModelSection(name_or_path=str(tiny_model)), PeftSection(rank=4),
                            quant=QuantizationSection(), precision="fp32", attention="sdpa", device="cpu",
                            memory=MemorySection(gradient_checkpointing=checkpointing), seed=0)
        for name, param in model.named_parameters():  # B starts at zero: give it values so A's grads are real
            if "lora_B" in name:
                torch.nn.init.normal_(param, generator=torch.Generator().manual_seed(2))
        head, _ = find_fused_head(model)
        fused_loss_sum(model, masked_batch(tokenizer), head).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = grads(False), grads(mode)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


def test_max_gpu_memory_must_be_a_size(make_recipe):
    result = runner.invoke(app, ["validate", str(make_recipe(memory={"max_gpu_memory": "lots"}))])
    assert result.exit_code == 2 and "memory.max_gpu_memory" in result.output and "10GiB" in result.output


def test_the_heap_is_trimmed_only_when_the_resident_size_creeps_up():
    """After each backward pass: no trim while the resident size holds still (a trim costs the next step its page
    faults), one when it grows more than 10% above where it stood, and memory that a trim cannot give back (the
    optimizer's state arriving after the first step) raises the reference instead of being trimmed every step."""
    from gpupoor.train.heap import HeapTrimmer, heap_trimmer

    resident = [1000]
    trims = []

    def trim():
        trims.append(resident[0])
        resident[0] = min(resident[0], trimmed_to)

    heap = HeapTrimmer(trim, lambda: resident[0])
    trimmed_to = 1000
    for size in (1000, 1050, 1090, 1100):  # within 10% of the first: left alone
        resident[0] = size
        heap.after_backward()
    assert trims == []
    resident[0] = 1300  # the heap crept: trimmed back
    heap.after_backward()
    assert trims == [1300] and resident[0] == 1000 and heap.reference == 1000
    trimmed_to = 1500  # 500 that is really in use: trimmed once, then the new level is the reference
    for size in (1500, 1520, 1540):
        resident[0] = size
        heap.after_backward()
    assert trims == [1300, 1500] and heap.reference == 1500
    assert heap_trimmer("cuda") is None  # a GPU's activations are not in the C heap
