"""Does the peak RSS of a CPU run creep up step after step, and what does trimming the C heap cost?

Runs `gpupoor train` for --steps steps on plan_accuracy.py's recipes (its random-weight models and data, built
on first use) with this checkout and with earlier commits (--before, comma-separated, each checked out into
build/heap-before-COMMIT with `git worktree`; its gpupoor is imported first through PYTHONPATH), the builds
alternating, each run between two matmul probes (bench/machine.py). Reports the peak RSS after step 1, at the middle and at the end, and the
median step time after the first step.

    python bench/heap_trim.py --before COMMIT[,COMMIT] [--steps 20] [--rounds 2] [--only seq2048-no-ckpt,...] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_accuracy  # noqa: E402
from machine import ROOT, Steady, shown_command, spread, write_section  # noqa: E402

BEFORE = ROOT / "build" / "heap-before-{}"
RECIPES = ("seq2048-no-ckpt", "packed-batch", "seq2048-ckpt")


def checkout(commit: str) -> Path:
    target = Path(str(BEFORE).format(commit))
    remove(target)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(target), commit], check=True,
                   capture_output=True)
    return target


def remove(worktree: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], capture_output=True)


def train(name: str, steps: int, source: Path | None) -> dict:
    run_dir = plan_accuracy.WORK / "runs" / f"heap-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if source is not None:
        env["PYTHONPATH"] = str(source)
    out = subprocess.run([sys.executable, "-m", "gpupoor", "train", str(plan_accuracy.recipe_file(name)),
                          "--output-dir", str(run_dir), "--set", f"training.max_steps={steps}"],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"gpupoor train {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "peak_mem_mb" in r and "step_s" in r]
    peaks = [r["peak_mem_mb"] for r in steps_]
    return {"first": peaks[0], "middle": peaks[len(peaks) // 2 - 1], "last": peaks[-1],
            "step_s": statistics.median(r["step_s"] for r in steps_[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="the commits to compare with, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(RECIPES)
    plan_accuracy.build_fixtures()
    sides: dict[str, Path | None] = {commit[:7]: checkout(commit) for commit in args.before.split(",")}
    sides["this checkout"] = None
    steady = Steady()
    steady.warm_up()
    results: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for name in names:
            for side, source in sides.items():
                result = steady.run(f"{name}, {side}, round {round_ + 1}",
                                    lambda name=name, source=source: train(name, args.steps, source))
                results.setdefault((name, side), []).append(result)
                print(f"  {name} {side}: peak {result['first']:.0f} -> {result['middle']:.0f} -> "
                      f"{result['last']:.0f} MiB, {result['step_s']:.2f} s/step, GFLOP/s "
                      f"{result['gflops_before']:.0f}/{result['gflops_after']:.0f}", flush=True)
    middle = args.steps // 2
    lines = [f"Command: `{shown_command('bench/heap_trim.py', sys.argv[1:])}` ({args.steps} steps, "
             f"{args.rounds} rounds, the sides alternating; medians with min-max). " + steady.summary(), "",
             f"| recipe | build | peak MiB after step 1 | after step {middle} | after step {args.steps} | "
             "step s (median after step 1) | GFLOP/s around its runs |", "|---|---|---:|---:|---:|---:|---|"]
    for (name, side), runs in results.items():
        def col(key: str, fmt: str = "{:.0f}") -> str:
            return spread([r[key] for r in runs], fmt)

        around = [v for r in runs for v in (r["gflops_before"], r["gflops_after"])]
        lines.append(f"| {name} | {side} | {col('first')} | {col('middle')} | {col('last')} | "
                     f"{col('step_s', '{:.2f}')} | {spread(around, '{:.0f}')} |")
    lines += ["", *steady.notes()]
    print("\n".join(lines))
    if not args.no_write:
        write_section(ROOT / "docs" / "benchmarks.md", "heap-trim", "\n".join(lines))
    for source in sides.values():
        if source is not None:
            remove(source)


if __name__ == "__main__":
    main()
