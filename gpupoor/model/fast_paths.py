"""`model.fused_layers`: the decoder's fast paths switched on where they apply (gpupoor.decisions.choose_fused_paths,
the rule `gpupoor plan` counts by too), and what the startup summary says about them. The paths themselves:
gpupoor.model.fused_lora (LoRA linears and the gated MLP as single autograd functions) and
gpupoor.model.packed_attention (attention per packed example)."""

from __future__ import annotations

from gpupoor.decisions import Choice, choose_fused_paths
from gpupoor.model.fused_lora import fuse_lora_layers
from gpupoor.model.kernels import apply_kernels  # noqa: F401 -- the run's other speed choice, where it installs both
from gpupoor.model.packed_attention import use_packed_attention


def apply_fast_paths(model, enabled: bool, *, method: str = "lora", dropout: float = 0.0, bits: int | None = None,
                     precision: str = "fp32") -> Choice:
    """Install on `model` (peft-wrapped or not) the fast paths the recipe's settings allow; the choice and why,
    for the summary. Each installed module still checks per call and hands over to the plain one where its
    arithmetic is not plain LoRA on a frozen dense base (a DPO reference pass with the adapter off, say)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = next(base.parameters()).device.type  # where the model computes (it is on its device by now)
    paths = choose_fused_paths(enabled, getattr(base.config, "model_type", None), method, dropout, bits, precision,
                               base.config._attn_implementation, device)
    if not (paths.mlp or paths.attention):
        return Choice("off", f"{paths.reason}: the plain transformers and peft modules")
    family, parts = base.config.model_type, []
    if paths.mlp:
        counts = fuse_lora_layers(base)
        parts.append(f"LoRA linears x{counts['linear']} and gated MLP x{counts['mlp']} as single functions (the MLP "
                     "recomputes its activation in backward)")
    if paths.attention:
        use_packed_attention(base)
        parts.append("sdpa per packed example")
    not_fused = f"; {paths.reason}" if paths.reason else ""
    return Choice("on", f"{family}: " + ", ".join(parts) + not_fused + "; model.fused_layers: false turns them off")
