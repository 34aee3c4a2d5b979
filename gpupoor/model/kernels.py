"""`model.kernels` and `model.compile`: faster kernels for the decoder on a GPU, each optional and measured on its
own (docs/benchmarks.md, "On a GPU"). Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU replace transformers' modules
on the families it patches (the loss stays gpupoor's own fused one); torch.compile compiles each decoder layer,
lazily, so the first step pays the compile time."""

from __future__ import annotations

from gpupoor.decisions import Choice
from gpupoor.errors import UserError

# Families whose Liger patches keep the layer's arithmetic (an RMSNorm, RoPE and a gated SiLU MLP).
LIGER_FAMILIES = ("llama", "qwen2", "mistral", "gemma", "qwen3")


def apply_kernels(model, kernels: str, compile_layers: bool) -> Choice:
    """Install the recipe's kernels on `model` (peft-wrapped or not, on its device); the choice for the summary."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = next(base.parameters()).device.type
    parts = []
    if kernels == "liger":
        parts.append(_apply_liger(base, device))
    if compile_layers:
        layers = decoder_layers(base)
        for layer in layers:
            layer.compile()  # in place: the module keeps its name, so checkpoints and adapters stay as they were
        parts.append(f"torch.compile of {len(layers)} decoder layers (the first steps compile)")
    if not parts:
        return Choice("none", "model.kernels: none, model.compile: false")
    return Choice("on", "; ".join(parts))


def _apply_liger(base, device: str) -> str:
    family = getattr(base.config, "model_type", None)
    if device != "cuda":
        return f"Liger kernels off: they are Triton kernels for CUDA, and this run is on the {device}"
    if family not in LIGER_FAMILIES:
        return f"Liger kernels off: {family} is not one of {', '.join(LIGER_FAMILIES)}"
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as error:
        raise UserError(f"model.kernels: liger needs the liger-kernel package ({error})",
                        hint="pip install 'gpupoor[liger]', or set model.kernels: none") from error
    # gpupoor's chunked loss already never holds the whole logits: Liger's own loss would only replace it.
    _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return f"Liger RMSNorm, RoPE and SwiGLU on {family}"


def decoder_layers(base) -> list:
    """The decoder layers of a causal LM (model.layers on every family gpupoor fuses)."""
    inner = getattr(base, base.base_model_prefix, base)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UserError(f"model.compile: {type(base).__name__} has no decoder layers gpupoor can find "
                        "(model.layers)", hint="set model.compile: false")
    return list(layers)
