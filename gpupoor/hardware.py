"""What the machine can do: device, precision and attention backend, each with the reason it was chosen."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from gpupoor.errors import UserError


@dataclass
class Choice:
    value: str
    reason: str


def resolve_device(requested: str) -> Choice:
    if requested == "cpu":
        return Choice("cpu", "training.device: cpu")
    if torch.cuda.is_available():
        return Choice("cuda", f"{torch.cuda.get_device_name(0)} found")
    if requested == "cuda":
        raise UserError("training.device = 'cuda' but torch sees no CUDA GPU "
                        f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})",
                        hint="install a CUDA build of torch, or set training.device: auto to use the CPU")
    return Choice("cpu", "no CUDA GPU found")


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


def resolve_precision(requested: str, device: str) -> Choice:
    if device == "cpu":
        if requested in ("auto", "fp32"):
            return Choice("fp32", "CPU trains in fp32" if requested == "auto" else "precision: fp32")
        if requested == "fp16":
            raise UserError("precision = 'fp16' needs a CUDA GPU; this run is on the CPU",
                            hint="use precision: auto (fp32 on CPU)")
        return Choice("bf16", "precision: bf16 (CPU autocast)")
    major, _ = _capability()
    # is_bf16_supported() answers yes on a T4 (sm75) through emulation, which is slow: ask for real support.
    native_bf16 = major >= 8
    if requested == "auto":
        if native_bf16:
            return Choice("bf16", f"GPU compute capability {major}.x supports bf16")
        return Choice("fp16", f"GPU compute capability {major}.x has no native bf16: fp16 + GradScaler")
    if requested == "bf16" and not native_bf16:
        raise UserError(f"precision = 'bf16' but this GPU (compute capability {major}.x) has no native bf16",
                        hint="use precision: fp16 or auto")
    return Choice(requested, f"precision: {requested}")


def resolve_attention(requested: str, device: str) -> Choice:
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "flash_attention_2":
        if device != "cuda" or not has_flash or _capability()[0] < 8:
            raise UserError("model.attention = 'flash_attention_2' needs flash-attn installed and an Ampere or "
                            "newer GPU", hint="pip install -e .[flash] on a CUDA machine, or use attention: auto")
        return Choice(requested, "model.attention: flash_attention_2")
    if requested != "auto":
        return Choice(requested, f"model.attention: {requested}")
    if device == "cuda" and has_flash and _capability()[0] >= 8:
        return Choice("flash_attention_2", "flash-attn installed and GPU supports it")
    why = "flash-attn not installed" if not has_flash else ("CPU run" if device == "cpu" else "GPU older than Ampere")
    return Choice("sdpa", f"{why}: torch SDPA")


def resolve_sampler(requested: str, attention: str, trust_remote_code: bool) -> Choice:
    """Packing is exact when the model's attention follows transformers' packed-sequence masks (restarted
    position_ids, no attention mask, no KV cache): its own model code with sdpa, eager or flash-attention 2."""
    if requested != "auto":
        return Choice(requested, f"data.sampler: {requested}")
    if trust_remote_code:
        return Choice("length_grouped", "remote model code may not isolate packed examples")
    if attention in ("sdpa", "eager", "flash_attention_2"):
        return Choice("packed", f"{attention} isolates packed examples")
    return Choice("length_grouped", f"{attention} attention may not isolate packed examples")


def usable_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def dtype_of(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
