"""Start-up latency: how long gpupoor's commands take when there is (almost) nothing to train, against the floor
of importing what they import, and the non-training part of a real run.

Commands, each a fresh process, wall time from launch to exit (and the process's own peak RSS, from wait4):

    import-torch   python -c "import torch"                                   the floor of any torch program
    import-stack   python -c "import torch, transformers, peft, accelerate"   the floor of a training stack
    smoke          gpupoor train recipes/demo.yaml --smoke --output-dir TMP   the end-to-end check
    validate       gpupoor validate recipes/demo.yaml
    plan           gpupoor plan recipes/demo.yaml
    fixture        the issue's reference fixture run (bench/compare_trl.py's gpupoor-packed side: 160 rows, vocab
                   32000): whole process - training time (metrics.jsonl elapsed_s) = the non-training overhead,
                   split at the run's "start" record into before the loop and the rest; and the start-up
                   breakdown (seconds per phase: `startup_s`, or `startup`) when the start record carries one

Run from the project root with GPUPOOR_CACHE=build/bench/gpupoor-cache (the demo model gpupoor:demo is built
there once, by a warm-up run of every command before the first round, and reused). The commands alternate in
every round, each between two matmul probes (bench/machine.py: a run the machine was busy for is rejected and
repeated). Writes the section `startup` of docs/benchmarks.md.

    python bench/startup.py [--rounds 5] [--only smoke,plan,...] [--kit ../shared/bench]

About 5 minutes with the defaults on a quiet 2-core machine (a round: ~35 s of commands, ~15 s of probes).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import REFERENCE_ROWS, build_fixture, read_metrics, run_gpupoor  # noqa: E402
from machine import ROOT, Steady, shown_command, spread, usable_cores, write_section  # noqa: E402

PYTHON = str(ROOT / ".venv" / "bin" / "python")
GPUPOOR = str(ROOT / ".venv" / "bin" / "gpupoor")
CACHE = ROOT / "build" / "bench" / "gpupoor-cache"
WORK = ROOT / "build" / "bench" / "startup"
DEMO = "recipes/demo.yaml"
COMMANDS = {  # name -> (argv; "{tmp}" is a fresh output folder, what the table calls it)
    "import-torch": ([PYTHON, "-c", "import torch"], 'python -c "import torch"'),
    "import-stack": ([PYTHON, "-c", "import torch, transformers, peft, accelerate"],
                     'python -c "import torch, transformers, peft, accelerate"'),
    "smoke": ([GPUPOOR, "train", DEMO, "--smoke", "--output-dir", "{tmp}"],
              f"gpupoor train {DEMO} --smoke --output-dir TMP"),
    "validate": ([GPUPOOR, "validate", DEMO], f"gpupoor validate {DEMO}"),
    "plan": ([GPUPOOR, "plan", DEMO], f"gpupoor plan {DEMO}"),
}


def environment() -> dict[str, str]:
    return {**os.environ, "GPUPOOR_CACHE": str(CACHE), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def timed_process(argv: list[str]) -> dict:
    """Wall seconds from launch to exit and the process's peak RSS (wait4 gives this child's own rusage)."""
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
    argv = [arg.replace("{tmp}", str(tmp / "out")) for arg in argv]
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        process = subprocess.Popen(argv, cwd=ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        if process.returncode != 0:
            log.seek(0)
            raise SystemExit(f"failed (exit {process.returncode}): {' '.join(argv)}\n{log.read()[-3000:]}")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def fixture_run(kit: Path, fixture: Path) -> dict:
    """The reference fixture's gpupoor run: where its non-training time goes."""
    launched = time.time()
    result = run_gpupoor(kit, fixture, "packed", False, [], run_dir=WORK / "fixture-run")
    start, _ = read_metrics(Path(result["run_dir"]))
    before_loop = start["time"] - launched if start and "time" in start else float("nan")
    overhead = result["wall_s"] - result["train_s"]
    return {"wall_s": result["wall_s"], "train_s": result["train_s"], "overhead_s": overhead,
            "before_loop_s": before_loop, "after_s": overhead - before_loop, "peak_rss_mb": result["peak_rss_mb"],
            "startup": result.get("startup")}


def warm_up(names: list[str], kit: Path | None, fixture: Path | None) -> None:
    """Once each, unmeasured: builds gpupoor:demo into the cache, tokenizes the data, fills the page cache."""
    print(f"warm-up (GPUPOOR_CACHE={CACHE}) ...", flush=True)
    for name in names:
        timed_process(COMMANDS[name][0])
    if fixture is not None:
        fixture_run(kit, fixture)


def measure(names: list[str], rounds: int, kit: Path | None, fixture: Path | None,
            steady: Steady) -> dict[str, list[dict]]:
    jobs = {name: (lambda name=name: timed_process(COMMANDS[name][0])) for name in names}
    if fixture is not None:
        jobs["fixture"] = lambda: fixture_run(kit, fixture)
    results: dict[str, list[dict]] = {name: [] for name in jobs}
    order = list(jobs)
    for round_index in range(rounds):
        shift = round_index % len(order)  # the first command of a round changes from round to round
        for name in order[shift:] + order[:shift]:
            result = steady.run(f"{name}, round {round_index + 1}", jobs[name])
            results[name].append(result)
            print(f"round {round_index + 1} {name}: {result['wall_s']:.2f} s, {result['peak_rss_mb']:.0f} MB, "
                  f"GFLOP/s {result['gflops_before']:.0f}/{result['gflops_after']:.0f}"
                  f"{' (noisy)' if result['noisy'] else ''}", flush=True)
    return results


def startup_phases(runs: list[dict]) -> list[str]:
    """The start record's `startup` breakdown (seconds per phase), median (min-max) over the runs."""
    breakdowns = [run["startup"] for run in runs if isinstance(run.get("startup"), dict)]
    if not breakdowns:
        return []
    phases = [key for key, value in breakdowns[0].items() if isinstance(value, (int, float))]
    lines = ["| start-up phase (the run's start record in metrics.jsonl) | seconds |", "|---|---:|"]
    lines += [f"| {phase} | {spread([b[phase] for b in breakdowns if phase in b], '{:.2f}')} |" for phase in phases]
    return lines


def render(results: dict[str, list[dict]], steady: Steady, rounds: int, command: str) -> str:
    lines = ["### Start-up latency", "",
             f"`{command}` on {usable_cores()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}, from the "
             "project root with a warm cache (gpupoor:demo built, data tokenized, one unmeasured run of each "
             f"command first). Wall time from launch to exit of a fresh process, median (min-max) of {rounds} "
             "alternating rounds; peak RSS of that process. " + steady.summary(), "",
             "| command | wall s | peak RSS MB | GFLOP/s before | GFLOP/s after |", "|---|---:|---:|---:|---:|"]
    for name, runs in results.items():
        if name == "fixture":
            continue
        lines.append(f"| `{COMMANDS[name][1]}` | {spread([r['wall_s'] for r in runs])} | "
                     f"{spread([r['peak_rss_mb'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['gflops_before'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['gflops_after'] for r in runs], '{:.0f}')} |")
    if "smoke" in results and "import-torch" in results:
        smoke = statistics.median(r["wall_s"] for r in results["smoke"])
        torch_only = statistics.median(r["wall_s"] for r in results["import-torch"])
        lines += ["", f"`--smoke` takes {smoke / torch_only:.1f}x the time of `import torch` alone (medians)."]
    if "fixture" in results:
        lines += ["", *fixture_lines(results["fixture"])]
    notes = steady.notes()
    if notes:
        lines += ["", "Runs the probe flagged:", *notes]
    return "\n".join(lines) + "\n"


def fixture_lines(runs: list[dict]) -> list[str]:
    def col(key: str, fmt: str = "{:.2f}") -> str:
        return spread([r[key] for r in runs], fmt)

    lines = [f"The issue's reference fixture ({REFERENCE_ROWS} rows, vocab 32000, `gpupoor train` packed, no "
             "checkpointing, one epoch; bench/compare_trl.py's recipe): whole process "
             f"{col('wall_s')} s, training {col('train_s')} s (the steps' `elapsed_s`), so {col('overhead_s')} s "
             f"outside the steps: {col('before_loop_s')} s from launch to the run's start record (imports, data, "
             f"model; the kit's measure.py launches it) and {col('after_s')} s after it apart from the steps (the "
             f"loop's set-up, the final save and report). Peak RSS {col('peak_rss_mb', '{:.0f}')} MB."]
    phases = startup_phases(runs)
    if phases:
        lines += ["", *phases]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated subset of " + ", ".join([*COMMANDS, "fixture"]))
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to write into")
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name] or [*COMMANDS, "fixture"]
    unknown = [name for name in chosen if name not in COMMANDS and name != "fixture"]
    if unknown:
        raise SystemExit(f"unknown commands {unknown}: choose from {', '.join([*COMMANDS, 'fixture'])}")
    names = [name for name in chosen if name in COMMANDS]
    kit, fixture = Path(args.kit), None
    if "fixture" in chosen:
        if not (kit / "fixture.py").is_file():
            raise SystemExit(f"the peer benchmark kit is not at {kit} (the reference fixture is built by its "
                             "fixture.py): pass --kit PATH, or leave `fixture` out with --only")
        fixture = build_fixture(kit, 32000, REFERENCE_ROWS)
    warm_up(names, kit, fixture)
    steady = Steady()
    print(f"matmul reference: {steady.warm_up():.0f} GFLOP/s", flush=True)
    results = measure(names, args.rounds, kit, fixture, steady)
    body = render(results, steady, args.rounds, shown_command("bench/startup.py", sys.argv[1:]))
    write_section(Path(args.doc), "startup", body)
    print(body)
    if "fixture" in results and not startup_phases(results["fixture"]):
        print("(the fixture run's start record carries no start-up breakdown: `startup_s` or `startup`)")


if __name__ == "__main__":
    main()
