"""What bf16 matmuls cost against fp32 on this CPU (issue #42): F.linear at SmolLM2's MLP shape, gpupoor's own
start-up probe (gpupoor.hardware.bf16_matmul_speedup) and a plain `a @ b`, fp32 and bf16 alternating, medians,
bracketed by bench/machine.py's fp32 matmul probe. On a CPU with bf16 matrix units bf16 is the faster one; without
them it is emulated. docs/benchmarks.md, "Mixed precision on the CPU".

    python bench/cpu_bf16_cost.py THREADS
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import gflops  # noqa: E402

from gpupoor.cpu import this_cpus_bf16_units  # noqa: E402
from gpupoor.hardware import bf16_matmul_speedup  # noqa: E402


def rate(dtype, product, shapes) -> float:
    """GFLOP/s of one `product` of fresh random operands of `shapes` in `dtype`, after a warm-up call."""
    a, b = (torch.randn(*shape, dtype=dtype) for shape in shapes)
    product(a, b)
    started = time.perf_counter()
    product(a, b)
    m, k = shapes[0]
    n = shapes[1][0] if product is torch.nn.functional.linear else shapes[1][1]
    return 2 * m * k * n / (time.perf_counter() - started) / 1e9


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    before = gflops(threads)
    cases = {"F.linear 1024 x 576 -> 1536": (torch.nn.functional.linear, ((1024, 576), (1536, 576)), 5),
             "a @ b 256 x 576 @ 576 x 1536": (torch.matmul, ((256, 576), (576, 1536)), 3)}
    lines = []
    for name, (product, shapes, rounds) in cases.items():
        measured = {torch.float32: [], torch.bfloat16: []}
        for _ in range(rounds):  # alternating
            for dtype in measured:
                measured[dtype].append(rate(dtype, product, shapes))
        fp32, bf16 = (statistics.median(values) for values in measured.values())
        lines.append(f"{name}: fp32 {fp32:.1f}, bf16 {bf16:.1f} GFLOP/s, bf16/fp32 {bf16 / fp32:.3f}")
    ratios = [bf16_matmul_speedup(576, 1536, rows=256) for _ in range(5)]
    started = time.perf_counter()
    bf16_matmul_speedup(576, 1536, rows=32)
    probe_ms = (time.perf_counter() - started) * 1e3
    after = gflops(threads)
    print(f"{threads} thread(s); bf16 units: {this_cpus_bf16_units() or 'none'}; fp32 probe {before:.0f} -> "
          f"{after:.0f} GFLOP/s")
    print("\n".join(lines))
    print(f"gpupoor's probe bf16/fp32: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f});"
          f" the 32-row probe took {probe_ms:.0f} ms")


if __name__ == "__main__":
    main()
