"""Shared by the distill_loss tests (moved from unit/objectives/test_distill_loss.py, whose tests still use them)."""

from __future__ import annotations


def _largest_allocation_and_peak(run) -> tuple[int, int]:
    """The largest single allocation and the peak of new live memory (bytes) while `run()` runs: every event
    of the CPU allocator that the profiler records (inside kernels too), with the running total it keeps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if type(event.extra_fields).__name__ == "_ExtraFields_Allocation":
            allocations.append((event.extra_fields.alloc_size, event.extra_fields.total_allocated))
    assert allocations, "the profiler recorded no allocations"
    return max(size for size, _ in allocations), max(total for _, total in allocations)
