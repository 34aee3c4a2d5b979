"""What this machine can do, read from torch: the facts that `gpupoor.decisions` turns into a device, precision,
attention backend and sampler (each with the reason it was chosen), and the one precision-to-dtype map."""

from __future__ import annotations

import importlib.util
import os

import torch

from gpupoor.decisions import (Choice, choose_attention, choose_device, choose_inference_precision,
                               choose_precision, choose_sampler)

__all__ = ["Choice", "DTYPES", "dtype_of", "resolve_attention", "resolve_device", "resolve_precision",
           "resolve_inference_precision", "resolve_sampler", "usable_cpu_count"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(requested: str) -> Choice:
    if requested == "cpu":
        return choose_device(requested, cuda_available=False)
    available = torch.cuda.is_available()
    return choose_device(requested, available, torch.cuda.get_device_name(0) if available else None,
                         torch_build=f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")


def _gpu_major(device: str) -> int | None:
    return torch.cuda.get_device_capability(0)[0] if device == "cuda" else None


def resolve_precision(requested: str, device: str) -> Choice:
    return choose_precision(requested, device, _gpu_major(device))


def resolve_inference_precision(device: str, trained: str | None) -> str:
    return choose_inference_precision(device, trained, _gpu_major(device))


def resolve_attention(requested: str, device: str) -> Choice:
    flash_installed = importlib.util.find_spec("flash_attn") is not None
    return choose_attention(requested, device, flash_installed, _gpu_major(device))


def resolve_sampler(requested: str, attention: str, trust_remote_code: bool) -> Choice:
    return choose_sampler(requested, attention, trust_remote_code)


def usable_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def busy_cpu_cores(sample_s: float = 0.2) -> float | None:
    """How many cores other processes keep busy right now: the machine's non-idle CPU time over `sample_s`
    (/proc/stat), in cores. None where /proc/stat cannot be read (not Linux)."""
    import time

    def totals() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            fields = [int(value) for value in handle.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total_before, idle_before = totals()
        time.sleep(sample_s)
        total_after, idle_after = totals()
    except (OSError, ValueError, IndexError):
        return None
    elapsed = total_after - total_before
    if elapsed <= 0:
        return None
    return (os.cpu_count() or 1) * (1 - (idle_after - idle_before) / elapsed)


def dtype_of(precision: str) -> torch.dtype:
    return DTYPES[precision]
