"""What this machine can do, read from torch: the facts that `gpupoor.decisions` turns into a device, precision,
attention backend and sampler (each with the reason it was chosen), and the one precision-to-dtype map."""

from __future__ import annotations

import importlib.util
import os

import torch

from gpupoor import cpu as cpu_facts
from gpupoor.cpu import pinned_bf16
from gpupoor.decisions import (Choice, CpuBf16, choose_attention, choose_device, choose_inference_precision,
                               choose_precision, choose_sampler)

__all__ = ["Choice", "DTYPES", "bf16_matmul_speedup", "cpu_bf16", "dtype_of", "resolve_attention", "resolve_device",
           "resolve_precision", "resolve_inference_precision", "resolve_sampler", "usable_cpu_count"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(requested: str) -> Choice:
    if requested == "cpu":
        return choose_device(requested, cuda_available=False)
    available = torch.cuda.is_available()
    return choose_device(requested, available, torch.cuda.get_device_name(0) if available else None,
                         torch_build=f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")


def _gpu_major(device: str) -> int | None:
    return torch.cuda.get_device_capability(0)[0] if device == "cuda" else None


def resolve_precision(requested: str, device: str, *, measure: bool = True, dims=None) -> tuple[Choice, CpuBf16]:
    """The precision and the CPU facts it was decided on (a GPU run: none). `measure`: run the CPU's matmul probe
    where a choice rests on it (else the flags decide alone); `dims`: a callable giving the model's (hidden,
    intermediate) for it, called only when it runs."""
    cpu = cpu_bf16(requested, dims, measure) if device == "cpu" else CpuBf16()
    return choose_precision(requested, device, _gpu_major(device), cpu), cpu


def resolve_inference_precision(device: str, trained: str | None) -> Choice:
    cpu = cpu_bf16("auto") if device == "cpu" else CpuBf16()
    return choose_inference_precision(device, trained, _gpu_major(device), cpu)


# The probe's matmul when the model's shapes are not at hand: a 0.5B model's (hidden, intermediate).
PROBE_DIMS = (1024, 2816)


def cpu_bf16(requested: str, dims=None, measure: bool = True) -> CpuBf16:
    """What this CPU does with bf16 matrices, as far as `requested` needs to know: its units from its flags, and
    the measured speedup where a choice rests on it (`auto` on a CPU with units; `bf16` on one without, for its
    warning). GPUPOOR_CPU_BF16 pins both (gpupoor.cpu)."""
    pinned = pinned_bf16()
    if pinned is not None:
        return pinned
    units = cpu_facts.this_cpus_bf16_units()  # (through the module: tests replace it)
    decides = (requested == "auto" and units) or (requested == "bf16" and not units)
    if not measure or not decides:
        return CpuBf16(units)  # fp32 asked, auto without units, bf16 with units: nothing to measure
    hidden, intermediate = dims() if dims is not None else PROBE_DIMS
    # At least a 0.5B model's shapes: a smaller matmul times the call's overhead, not the units' speed (the demo's
    # tiny model read 1.3x, 1.6x and 2.2x fp32 in one session against the 1.5x bar, so the same recipe trained in
    # fp32 one run and in bf16 the next). The smallest models are then decided as a 0.5B one would be.
    hidden, intermediate = max(hidden, PROBE_DIMS[0]), max(intermediate, PROBE_DIMS[1])
    # Emulated bf16 (no units, only for the warning) runs 5-90x slower: fewer rows keep the probe short there.
    return CpuBf16(units, bf16_matmul_speedup(hidden, intermediate, rows=256 if units else 32))


def bf16_matmul_speedup(hidden: int, intermediate: int, rows: int = 256) -> float:
    """fp32 time over bf16 time of one linear layer's matmul as a model runs it (rows x hidden through a hidden ->
    intermediate weight), each the best of three after a warm-up (oneDNN builds its bf16 kernel on the first
    call): ~10 ms on a CPU with units."""
    import time

    def best_time(dtype) -> float:
        x = torch.randn(rows, hidden, dtype=dtype)
        weight = torch.randn(intermediate, hidden, dtype=dtype)
        torch.nn.functional.linear(x, weight)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9)

    with torch.inference_mode():
        return best_time(torch.float32) / best_time(torch.bfloat16)


def resolve_attention(requested: str, device: str) -> Choice:
    flash_installed = importlib.util.find_spec("flash_attn") is not None
    return choose_attention(requested, device, flash_installed, _gpu_major(device))


def resolve_sampler(requested: str, attention: str, trust_remote_code: bool, objective: str = "sft") -> Choice:
    return choose_sampler(requested, attention, trust_remote_code, objective)


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
