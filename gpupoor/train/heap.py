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
import ctypes.util
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


def malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0) (every whole free page of every arena back to the OS), or None without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def release() -> None:
        trim(0)  # 0: keep no padding at the heap's top

    return release


def resident_bytes() -> int:
    """This process's resident size now (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
