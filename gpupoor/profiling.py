"""`--profile N`: torch.profiler over N optimizer steps after a short warm-up, and where the step time goes.

The loop and the losses mark their parts with `span(NAME)`: data (collating the window, moving it to the
device, the count all-reduce), forward (the model's forward, a teacher's too), loss (the output head and the
loss, with the fused loss's gradient, which it computes in the same pass), backward, optimizer (clipping, the
step, the schedule). A span costs nothing while no profiler runs: it is a null context then.

Outputs in RUN_DIR/profile/: trace.json (Chrome / Perfetto: chrome://tracing or ui.perfetto.dev), top_ops.txt
(operators by self time), summary.json (each part's seconds over the profiled steps, and the steps' own time),
and on CUDA memory_snapshot-rank{N}.pickle (PyTorch's memory visualizer, pytorch.org/memory_viz). Several processes:
each writes trace-rank{N}.json; the first process writes the rest.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

PARTS = ("data", "forward", "loss", "backward", "optimizer")
WARMUP_STEPS = 2  # steps run before the profiled ones: the first steps allocate and tune, unlike the rest
_ACTIVE = False  # True while a profiler records: spans cost nothing otherwise


def span(part: str):
    """A named range in the profile (gpupoor/PART), or nothing when no profiler runs."""
    return torch.profiler.record_function(f"gpupoor/{part}") if _ACTIVE else contextlib.nullcontext()


class StepProfiler:
    """Profiles `steps` optimizer steps after WARMUP_STEPS; `step(record)` is called after every optimizer step
    with its metrics record. `say` prints the summary."""

    def __init__(self, steps: int, directory: Path, device: str, rank: int, main: bool, say):
        self.steps, self.directory, self.device, self.rank, self.main, self.say = steps, directory, device, rank, main, say
        self.seen = 0
        self.step_seconds: list[float] = []
        self.profiler = None

    def __enter__(self) -> "StepProfiler":
        global _ACTIVE
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)  # the memory viz's own recording API
        schedule = torch.profiler.schedule(wait=WARMUP_STEPS, warmup=1, active=self.steps, repeat=1)
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=False,
                                               on_trace_ready=self._write)
        with without_kineto_trace_lines():
            self.profiler.__enter__()
        _ACTIVE = True
        return self

    def step(self, record: dict) -> None:
        self.seen += 1
        if WARMUP_STEPS + 1 < self.seen <= WARMUP_STEPS + 1 + self.steps:  # the active window's steps
            self.step_seconds.append(record["step_s"])
        with without_kineto_trace_lines():  # the trace starts and stops inside step()
            self.profiler.step()

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = False
        with without_kineto_trace_lines():
            self.profiler.__exit__(*exc)
        if self.device == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.main and not self.step_seconds:
            self.say(f"profile: the run ended after {self.seen} steps, before the {WARMUP_STEPS + 1} warm-up steps "
                     "were done; nothing was profiled")

    def _write(self, profiler) -> None:
        """When the window ends, or when the run ends inside it (then the steps profiled so far)."""
        if not self.step_seconds:
            return  # the run ended during the warm-up
        self.directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.directory / ("trace.json" if self.main else f"trace-rank{self.rank}.json")))
        if self.device == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.directory / f"memory_snapshot-rank{self.rank}.pickle"))
        if not self.main:
            return
        averages = profiler.key_averages()
        sort = "self_cuda_time_total" if self.device == "cuda" else "self_cpu_time_total"
        (self.directory / "top_ops.txt").write_text(averages.table(sort_by=sort, row_limit=30))
        parts = {part: 0.0 for part in PARTS}
        for event in averages:
            if event.key.startswith("gpupoor/") and event.key[8:] in parts:
                parts[event.key[8:]] = event.cpu_time_total / 1e6  # microseconds of host time
        summary = {"steps": len(self.step_seconds), "step_s": sum(self.step_seconds), "parts_s": parts,
                   "casts": cast_counts(averages, len(self.step_seconds))}
        (self.directory / "summary.json").write_text(json.dumps(summary, indent=1))
        self.say(describe(summary, self.directory))


@contextlib.contextmanager
def without_kineto_trace_lines():
    """Kineto (torch.profiler's backend) writes `USDT:... profiler_start` / `profiler_stop` to the process's stderr
    (file descriptor 2, below Python) whenever a trace starts or stops: noise to a user. Those lines are dropped;
    anything else written to stderr meanwhile is passed on."""
    import os
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


# The op every dtype conversion (and, on a GPU, every host-device copy) runs through: Tensor.to, .float(), autocast.
CAST_OP = "aten::_to_copy"


def cast_counts(averages, steps: int) -> dict:
    """The conversions per profiled step and their share of its host time: in mixed precision the casts between
    bf16 activations and fp32 weights can cost more than the matmuls they feed (gpupoor.model.fused_lora)."""
    event = next((e for e in averages if e.key == CAST_OP), None)
    if event is None:
        return {"per_step": 0, "s": 0.0}
    return {"per_step": round(event.count / max(steps, 1), 1), "s": event.cpu_time_total / 1e6}


def describe(summary: dict, directory: Path) -> str:
    """A few lines: the share of step time each part took, and the dtype casts."""
    total, parts = summary["step_s"], summary["parts_s"]
    shares = ", ".join(f"{part} {seconds / max(total, 1e-9):.0%}" for part, seconds in parts.items())
    other = total - sum(parts.values())
    casts = summary.get("casts", {"per_step": 0, "s": 0.0})
    return (f"profile of {summary['steps']} steps ({total:.3f} s): {shares}, other {other / max(total, 1e-9):.0%}\n"
            f"  casts ({CAST_OP}): {casts['per_step']:g} per step, {casts['s'] / max(total, 1e-9):.0%} of the time\n"
            f"  trace, top operators and summary in {directory} (open trace.json in ui.perfetto.dev)")
