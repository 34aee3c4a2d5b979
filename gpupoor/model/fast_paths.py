"""`model.fused_layers`: the decoder's fast paths switched on for the families they are tested on, and what the
startup summary says about them. The paths themselves: gpupoor.model.fused_lora (LoRA linears and the gated MLP
as single autograd functions) and gpupoor.model.packed_attention (attention per packed example)."""

from __future__ import annotations

from gpupoor.decisions import FUSED_FAMILIES, Choice
from gpupoor.model.fused_lora import fuse_lora_layers
from gpupoor.model.packed_attention import use_packed_attention


def apply_fast_paths(model, enabled: bool) -> Choice:
    """Install the fast paths on `model` (the peft-wrapped model or the base) unless they are not `enabled` or the
    family is untested; the choice and why, for the summary."""
    if not enabled:
        return Choice("off", "model.fused_layers: false; the plain transformers and peft modules")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = getattr(base.config, "model_type", None)
    if family not in FUSED_FAMILIES:
        return Choice("off", f"{family} is not one of {', '.join(FUSED_FAMILIES)}, where they are tested: "
                      "the plain transformers and peft modules")
    counts = fuse_lora_layers(base)
    unused_attention = use_packed_attention(base)
    parts = []
    if counts["mlp"]:
        parts.append(f"gated MLP x{counts['mlp']} (recomputes its activation in backward)")
    if counts["linear"]:
        parts.append(f"LoRA linears x{counts['linear']}")
    parts.append("attention per packed example" if unused_attention is None
                 else f"attention as loaded ({unused_attention})")
    return Choice("on", f"{family}: " + ", ".join(parts) + "; each hands over to the plain module where its "
                  "arithmetic is not plain LoRA on a frozen dense base (model.fused_layers: false turns them off)")
