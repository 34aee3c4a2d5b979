"""Shared by the methods tests (moved from integration/test_methods.py, whose tests still use them)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from support.recipes import PEFT_METHODS


# The methods trained end to end here (the plan's tests cover the others too).
METHODS = {name: PEFT_METHODS[name] for name in ("lora", "dora", "ia3", "full", "full-last-layer-and-head",
                                                 "lora-last-layer")}


def final_tensors(run) -> dict[str, torch.Tensor]:
    final = run / "final"
    files = sorted(final.glob("*.safetensors"))
    tensors = {}
    for path in files:
        tensors.update({k: v.clone() for k, v in load_file(path).items()})
    return tensors


def _saved_bytes(model, batch) -> int:
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch, use_cache=False).logits.float().sum().backward()
    return sum(saved)


def _build(tiny_model, method: str, last_layers, checkpointing, **extra):
    from gpupoor.model.build import build_model
    from gpupoor.recipe.schema import MemorySection, ModelSection, PeftSection, QuantizationSection

    model = build_model(str(tiny_model), ModelSection(name_or_path=str(tiny_model)),
                        PeftSection(method=method, rank=4, last_layers=last_layers, **extra),
                        quant=QuantizationSection(), precision="fp32", attention="sdpa", device="cpu",
                        memory=MemorySection(gradient_checkpointing=checkpointing), seed=0)
    return model.train()


BATCH_IDS = torch.randint(5, 300, (2, 64), generator=torch.Generator().manual_seed(0))


BATCH = {"input_ids": BATCH_IDS, "attention_mask": torch.ones_like(BATCH_IDS)}
