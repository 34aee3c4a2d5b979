"""What every benchmark shares: the machine's matmul throughput, runs repeated when the machine was busy, the
markdown section writer and the "median (min-max)" formatter.

The machines these benchmarks run on are shared: another process on the cores halves a run's speed and says
nothing. So every measured run is bracketed by a probe of the machine's own speed (a fixed 2048 x 2048 fp32
matmul in a fresh process, GFLOP/s, with torch using the cores this process may use). A run whose lower probe
fell more than 10% below the best probe of the session is rejected and repeated (3 attempts; the last one is
kept and marked noisy), and the tables print the probes so a reader sees how quiet the machine was.

    python bench/machine.py [--repeat 5]    # probe the machine now: is it quiet enough to benchmark?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE_SIZE = 2048  # large enough to run at the BLAS's full speed, small enough for ~70 ms a product
PROBE_SECONDS = 0.5  # long enough to average over a scheduler tick or two, short next to any run
MAX_DROP = 0.10  # a probe this far below the session's best means something else held the cores
ATTEMPTS = 3
REUSE_PROBE_S = 2.0  # a probe this fresh (taken after the previous run) also serves as the next run's "before"

# A fresh interpreter each time: the probe must not share a thread pool or a heap with the benchmark.
PROBE = f"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
n = {PROBE_SIZE}
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
a, b, c = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype)
for _ in range(2):  # warm-up: the thread pool starts, the pages are touched
    torch.mm(a, b, out=c)
started = time.perf_counter(); torch.mm(a, b, out=c); one = time.perf_counter() - started
repetitions = max(3, round({PROBE_SECONDS} / one))
started = time.perf_counter()
for _ in range(repetitions):
    torch.mm(a, b, out=c)
print(2 * n ** 3 * repetitions / (time.perf_counter() - started) / 1e9)
"""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as gpupoor itself counts them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gflops(threads: int | None = None, dtype: str = "float32") -> float:
    """Matmul GFLOP/s of this machine right now in `dtype` (fp32 unless said: bfloat16 for a CPU's bf16 units),
    measured in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads or usable_cores()), dtype], capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip())


@dataclass
class Steady:
    """Runs measurements bracketed by probes; rejects and repeats those the machine was busy for.

    `reference` is the best probe seen this session (the machine's quiet speed). A run is kept when the lower
    of its two probes is at least (1 - max_drop) x reference; else it is repeated, up to `attempts` times, and
    the last attempt is kept and marked noisy. Every attempt lands in `log`, so the tables can show them."""

    max_drop: float = MAX_DROP
    attempts: int = ATTEMPTS
    threads: int | None = None
    reference: float = 0.0
    log: list[dict] = field(default_factory=list)  # one record per attempt: label, probes, verdict
    _last_probe: tuple[float, float] | None = None  # (GFLOP/s, monotonic time) of the latest probe

    def probe(self, fresh_within_s: float = 0.0) -> float:
        """A probe; the previous one when it is younger than `fresh_within_s` (nothing ran in between)."""
        now = time.monotonic()
        if self._last_probe is not None and now - self._last_probe[1] < fresh_within_s:
            return self._last_probe[0]
        value = gflops(self.threads)
        self.reference = max(self.reference, value)
        self._last_probe = (value, time.monotonic())
        return value

    def warm_up(self, probes: int = 3) -> float:
        """Set the reference before the first run, so that the first runs are judged too."""
        for _ in range(probes):
            self.probe()
        return self.reference

    def run(self, label: str, measure: Callable[[], dict]) -> dict:
        """measure() -> a dict of results; returns it with gflops_before/after, attempt and noisy added."""
        for attempt in range(1, self.attempts + 1):
            before = self.probe(fresh_within_s=REUSE_PROBE_S)
            result = measure()
            after = self.probe()
            low, floor = min(before, after), (1 - self.max_drop) * self.reference
            kept = low >= floor or attempt == self.attempts
            noisy = low < floor
            self.log.append({"label": label, "attempt": attempt, "before": before, "after": after,
                             "reference": self.reference, "kept": kept, "noisy": noisy})
            if kept:
                return {**result, "gflops_before": before, "gflops_after": after, "attempt": attempt,
                        "noisy": noisy}
        raise AssertionError("unreachable: the last attempt is always kept")

    def rejected(self) -> list[dict]:
        return [entry for entry in self.log if not entry["kept"]]

    def noisy_kept(self) -> list[dict]:
        return [entry for entry in self.log if entry["kept"] and entry["noisy"]]

    def judged_on_a_lower_reference(self) -> list[dict]:
        """Kept runs that passed against the reference of their time but not against the session's final best
        (the machine got faster later, so they may have been slowed): listed, not dropped."""
        floor = (1 - self.max_drop) * self.reference
        return [entry for entry in self.log
                if entry["kept"] and not entry["noisy"] and min(entry["before"], entry["after"]) < floor]

    def notes(self) -> list[str]:
        """Markdown bullet lines on the rejected and noisy runs, for under a table."""
        def probes(entry: dict) -> str:
            return f"{entry['before']:.0f} / {entry['after']:.0f} GFLOP/s before / after"

        lines = [f"- rejected and repeated: {e['label']} (attempt {e['attempt']}: {probes(e)}, reference "
                 f"{e['reference']:.0f})" for e in self.rejected()]
        lines += [f"- kept but noisy (attempt {e['attempt']} of {self.attempts}): {e['label']} ({probes(e)}, "
                  f"reference {e['reference']:.0f})" for e in self.noisy_kept()]
        lines += [f"- passed against the reference of its time ({e['reference']:.0f}) but not the session's best "
                  f"({self.reference:.0f}): {e['label']} ({probes(e)})" for e in self.judged_on_a_lower_reference()]
        return lines

    def summary(self) -> str:
        """One sentence for a table's caption: the session's probes and how many runs were repeated."""
        probes = [value for entry in self.log for value in (entry["before"], entry["after"])]
        if not probes:
            return "No runs were probed."
        return (f"Matmul probe ({PROBE_SIZE}x{PROBE_SIZE} fp32, {self.threads or usable_cores()} threads) over the "
                f"session: {spread(probes, '{:.0f}')} GFLOP/s, best {self.reference:.0f}; a run whose lower probe "
                f"fell more than {self.max_drop:.0%} below the best so far was repeated ({len(self.rejected())} "
                f"rejected, {len(self.noisy_kept())} kept as noisy after {self.attempts} attempts).")


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """"median (min-max)", or the value alone when there is one."""
    values = list(values)
    middle = fmt.format(statistics.median(values))
    if len(values) < 2:
        return middle
    return f"{middle} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def run_table_rows(results: dict[str, list[dict]], loss_key: str = "loss") -> list[str]:
    """One markdown row per configuration: training s, wall s, peak RSS, real tokens/s, loss and the probes, each
    as median (min-max) over its runs (compare_trl.py and method_table.py print these columns)."""
    rows = []
    for label, runs in results.items():
        def col(key: str, fmt: str) -> str:
            return spread([r[key] for r in runs], fmt)

        rows.append(f"| {label} | {col('train_s', '{:.1f}')} | {col('wall_s', '{:.1f}')} | "
                    f"{col('peak_rss_mb', '{:.0f}')} | {col('tokens_per_s', '{:.0f}')} | {col(loss_key, '{:.3f}')} | "
                    f"{col('gflops_before', '{:.0f}')} | {col('gflops_after', '{:.0f}')} |")
    return rows


def probes_cell(runs: Sequence[dict]) -> str:
    """The GFLOP/s probes around each run, "before/after", noisy runs marked: a table's last column."""
    return ", ".join(f"{r['gflops_before']:.0f}/{r['gflops_after']:.0f}{' noisy' if r['noisy'] else ''}" for r in runs)


def alternate_rounds(steady: "Steady", sides: Sequence[str], rounds: int, measure: Callable[[str], dict],
                     describe: Callable[[dict], str], swap_order: bool = False) -> dict[str, list[dict]]:
    """`rounds` runs of every side, alternating (and with `swap_order`, which side goes first too): a slow spell of
    the machine hits every side alike. Each run is probed (`steady`) and a line describing it printed."""
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for number in range(rounds):
        for name in sides[::-1] if swap_order and number % 2 else sides:
            result = steady.run(name, lambda: measure(name))
            results[name].append(result)
            print(f"round {number + 1} {name}: {describe(result)}", flush=True)
    return results


def save_results(out: Path, args: argparse.Namespace, results: dict, steady: "Steady", **extra) -> None:
    """OUT/results.json: the arguments, the raw figures of every run, the probes and whatever else the caller adds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **extra,
                                                  "results": results, "probes": steady.log}, indent=1))


def fresh_run_dir(out: Path, side: int) -> Path:
    """A run directory of its own under OUT/runs (a repeated attempt gets a new one)."""
    run_dir = out / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns()}-{side}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_dir


def step_timer(times: list[float]):
    """A transformers TrainerCallback appending each optimizer step's seconds to `times` (the peers' side)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.started)

    return StepTimes()


def median_of(runs: Sequence[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def write_section(doc: Path, key: str, body: str) -> None:
    """Replace the block between <!-- bench:KEY --> and <!-- /bench:KEY --> in `doc` (append it when absent):
    each benchmark owns its block, and the prose around the blocks is left alone."""
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def write_recipe(path: Path, settings: dict) -> Path:
    """A recipe file from dotted keys ({"training.max_steps": 3} -> training: {max_steps: 3}), as JSON (which is
    YAML)."""
    tree: dict = {}
    for key, value in settings.items():
        node = tree
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tree, indent=1))
    return path


def shown_command(script: str, argv: Sequence[str], hidden: Sequence[str] = ("--kit", "--doc")) -> str:
    """The command line as a table quotes it: options that only say where things are on this machine dropped."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in hidden:
            skip = "=" not in arg
            continue
        shown.append(arg)
    return " ".join([f"python {script}", *shown])


def own_peak_rss_mb() -> float:
    """This process's own high-water mark (VmHWM), as gpupoor reports its peak: ru_maxrss would carry over the
    launching process's mark."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def run_in(command: list[str], cwd: Path) -> str:
    """A command's stdout; its output shown when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    readings = [gflops(args.threads) for _ in range(args.repeat)]
    print(f"{PROBE_SIZE}x{PROBE_SIZE} fp32 matmul, {args.threads or usable_cores()} threads: "
          f"{spread(readings, '{:.0f}')} GFLOP/s over {args.repeat} probes")


if __name__ == "__main__":
    main()
