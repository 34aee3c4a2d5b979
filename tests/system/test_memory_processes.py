"""The system tier of test_memory.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import sys

import pytest

from support.memory import HEAP_PROBE, REUSE_PROBE


def test_peak_memory_is_this_processes_own_after_a_fork():
    """gpupoor reports its own peak RSS: Linux's ru_maxrss would carry over the high-water mark of the process
    it was forked from (a notebook or a benchmark launching `gpupoor train` with subprocess)."""
    import subprocess
    import sys

    from gpupoor.train.loop import peak_memory_mb

    ballast = bytearray(600 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touched, so resident
    with open("/proc/self/status") as status:  # the parent's resident size now, ballast included
        parent_mb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    probe = ("import resource, torch; from gpupoor.train.loop import peak_memory_mb; "
             "print(peak_memory_mb(torch.device('cpu')), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    # preexec_fn makes subprocess fork (not vfork/posix_spawn), which is what carries the parent's mark over.
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: None)
    own_mb, inherited_mb = map(float, out.stdout.split())
    del ballast
    # ru_maxrss in the child carries (most of) the parent's size over; the child's own figure does not.
    assert inherited_mb > own_mb + 400, (inherited_mb, own_mb)
    assert own_mb < parent_mb - 400, (own_mb, parent_mb)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_the_heap_trimmer_returns_freed_heap_pages_to_the_os():
    """What gpupoor.train.heap does when a CPU run's resident size creeps up: 199 MiB freed inside the heap stays
    resident until it is trimmed (the control), and the trim gives it back."""
    import subprocess

    def run(mode: str) -> tuple[float, float]:
        out = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, check=True)
        before, after = map(float, out.stdout.split())
        return before, after

    kept_before, kept_after = run("keep")
    assert kept_after > kept_before - 20, (kept_before, kept_after)  # freed, yet still resident
    trimmed_before, trimmed_after = run("trim")
    assert trimmed_after < trimmed_before - 150, (trimmed_before, trimmed_after)


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[always]" in setting.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
@pytest.mark.skipif(_huge_pages_always(), reason="THP 'always' faults a fresh mapping in 2 MiB at a time: the control "
                                                 "count below is for 4 KiB pages")
def test_the_heap_trimmer_is_the_only_one_to_give_freed_memory_back():
    """With gpupoor's mallopt settings a freed 24 MiB block is reused in place; glibc's defaults unmap it and
    fault 6,144 pages in afresh for the next one, which is what made real-model steps 20-35% slower."""
    import subprocess

    def faults(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", REUSE_PROBE, mode], capture_output=True, text=True, check=True)
        return tuple(map(int, out.stdout.split()))

    pinned, refaults = faults("default")
    assert pinned == 0 and refaults >= 6000, refaults  # the control: 24 MiB / 4 KiB = 6,144 fresh pages
    pinned, refaults = faults("pinned")
    assert pinned == 1 and refaults < 100, refaults
