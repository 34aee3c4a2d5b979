"""Hand the C heap's free pages back to the OS when a CPU run's resident size creeps up (glibc).

A training step on the CPU allocates and frees activations of every size. glibc serves the large ones from its
heap once its dynamic mmap threshold has risen (it does after the first big free) and keeps what is freed for
reuse. Usually the next step reuses it and the resident size holds still. But the free space can fragment so
the heap grows instead: in some runs the peak RSS crept up step after step (a 2 x 2048-token recipe: 1299 ->
1729 MiB over 20 steps, still rising), in others, at another time on the same machine, not at all.
`malloc_trim(0)` gives every whole free page back, but after every step it cost 8-10% of the step time (each
page faulted in again; docs/benchmarks.md, "Where the CPU memory went"). So the resident size is read after
each backward pass (one /proc read) and the heap trimmed only when it has grown more than GROWTH above where it
stood: a run whose heap holds still never pays, and one whose heap creeps is held near its first steps.
Not on a GPU: there the activations live in torch's caching allocator, not in the C heap.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable

GROWTH = 0.10  # trim when the resident size after a backward pass is this much above its reference


class HeapTrimmer:
    """Call after each backward pass. The reference is the resident size after the first one, raised to what a
    trim leaves when a trim cannot bring it lower (memory that is really in use: the optimizer's state after
    the first step, say), so growth that is not the heap's is paid for once, not every step."""

    def __init__(self, trim: Callable[[], None], resident: Callable[[], int], growth: float = GROWTH):
        self.trim, self.resident, self.growth = trim, resident, growth
        self.reference: int | None = None
        self.trims = 0

    def after_backward(self) -> None:
        now = self.resident()
        if self.reference is None:
            self.reference = now
        elif now > self.reference * (1 + self.growth):
            self.trim()
            self.trims += 1
            self.reference = max(self.reference, self.resident())


def heap_trimmer(device_type: str) -> HeapTrimmer | None:
    """The trimmer for this process, or None where there is nothing to do: training on a GPU, or a C library
    without malloc_trim (macOS, musl)."""
    trim = malloc_trim() if device_type == "cpu" else None
    return HeapTrimmer(trim, resident_bytes) if trim is not None else None


# glibc's mallopt parameters (malloc.h), and the values gpupoor sets for a CPU process.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's top is never given back on glibc's own account


def serve_tensors_from_heap() -> bool:
    """Have glibc serve every block under 32 MiB from its heap and keep the heap's free top, from the first step.

    Left to itself glibc maps each block above its dynamic mmap threshold (128 KiB at start, rising only as
    mapped blocks are freed) afresh and unmaps it when freed, and gives the heap's free top back above a trim
    threshold that follows it. A training step frees and reallocates the same activation-sized blocks layer after
    layer, so each came back as fresh pages, every one faulted in again. On the real model (SmolLM2-135M, 8 x 512
    packed tokens, 2 threads) a step took 24-34 s that way and 19.6-21.4 s with the thresholds pinned, at the
    same peak (5.0-5.1 GB; docs/benchmarks.md). A heap that creeps is still trimmed by HeapTrimmer. Returns
    whether it was set: not on a C library without mallopt, nor where the environment sets glibc's own
    (GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), which wins."""
    if any(os.environ.get(name) for name in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _libc_function(name: str, argtypes: list):
    """glibc's `name` with its argument types (returning int), or None off Linux or where the C library lacks it.
    Looked up among the symbols the process has loaded already (libc's among them): ctypes.util.find_library
    would run ldconfig in a subprocess on every start of the command (~10 ms)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0) (every whole free page of every arena back to the OS), or None without it."""
    trim = _libc_function("malloc_trim", [ctypes.c_size_t])
    if trim is None:
        return None

    def release() -> None:
        trim(0)  # 0: keep no padding at the heap's top

    return release


def resident_bytes() -> int:
    """This process's resident size now (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
