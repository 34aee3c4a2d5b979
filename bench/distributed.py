"""Peak memory of each process and the time of one process, DDP x2 and FSDP x2, on a model of the peer kit's
fixture family (the kit's fixture.py at a larger size: hidden 512, 8 layers, vocab 8000, about 32M parameters;
the same data rows and tokenizer as bench/compare_trl.py and bench/methods.py).

Full fine-tuning with AdamW (weights + gradients + two moments per parameter) makes the memory weight-dominated,
so what FSDP shards shows. All configurations do the same optimizer steps on the same data: micro batch 1 on
each of two processes, or micro batch 1 x gradient accumulation 2 on one. `--lora` adds LoRA r16 on the same
model; `--mmap-threshold` adds each layout with glibc's mmap threshold fixed at 1 MiB (on a CPU, the RSS
counts what the allocator keeps, not only live tensors). Each process gets cores / processes threads
(gpupoor's default would give every process all the cores).

Each process runs gpupoor in-process under this file's `--worker` mode and writes, at exit, its own ru_maxrss
(metrics.jsonl holds rank 0's only) plus two things the whole-run peak hides: the peak before the training loop
(loading the whole model, then sharding it) and the peak inside the training loop (the high-water mark is reset
when the loop starts; metrics.jsonl's peak_mem_mb of these runs is therefore the in-loop peak), and its RSS
at exit. The configurations alternate within every round; the machine's fp32
matmul GFLOP/s (bench/methods.py's probe) is measured before and after every run, and a run where it fell below
80% of the session's best is repeated once and marked when it still is. Nothing is written to docs/: the table
is printed, the raw figures go to build/bench/distributed/results.json.

    python bench/distributed.py [--rounds 3] [--lora] [--mmap-threshold] [--quick] [--kit ../shared/bench]

Worker mode (what the driver launches; any gpupoor command line after the result folder):

    torchrun --standalone --nproc_per_node 2 bench/distributed.py --worker RESULT_DIR train RECIPE ...
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

WORKER_FLAG = "--worker"


# ----------------------------------------------------------------------------------------------------------
# Worker: one process of a run (rank 0 of one, or one of torchrun's)


def _status_mb(key: str) -> float | None:
    """A line of /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark) in MiB."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _reset_high_water_mark() -> bool:
    """Linux >= 4.0: writing 5 to clear_refs sets the peak RSS (VmHWM, and ru_maxrss with it) to the RSS now."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _watch_training_loop(marks: dict) -> None:
    """Wrap gpupoor's training loop (run.py imports it when the loop starts, so the module attribute is what it
    calls): note the memory when the model is loaded (and sharded) and the optimizer built, reset the
    high-water mark, and read it again when the loop returns, before the final checkpoint and weights."""
    import gpupoor.train.loop as loop

    original = loop.train

    def measured(*args, **kwargs):
        marks["load_peak_rss_mb"] = max(_maxrss_mb(), _status_mb("VmHWM") or 0.0)
        marks["rss_loop_start_mb"] = _status_mb("VmRSS")
        reset = _reset_high_water_mark()
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            marks["train_loop_s"] = time.perf_counter() - started
            marks["rss_loop_end_mb"] = _status_mb("VmRSS")
            marks["train_peak_rss_mb"] = _status_mb("VmHWM") if reset else None

    loop.train = measured


def worker(result_dir: Path, gpupoor_args: list[str]) -> None:
    # Run as a script, this file's folder is first on sys.path: its module names (distributed, methods) must
    # not shadow installed packages for gpupoor and the libraries it imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    rank = int(os.environ.get("RANK", "0"))
    marks: dict = {}
    code: int | str | None = 0
    try:
        _watch_training_loop(marks)
        from gpupoor.cli import app

        app(gpupoor_args, prog_name="gpupoor")
    except SystemExit as exc:
        code = exc.code
    finally:
        peak = max(_maxrss_mb(), _status_mb("VmHWM") or 0.0, marks.get("load_peak_rss_mb", 0.0))
        record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "exit_code": code,
                  "peak_rss_mb": peak, "rss_at_exit_mb": _status_mb("VmRSS"), **marks}
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / f"rank-{rank}.json").write_text(json.dumps(record))
    sys.exit(code)


# ----------------------------------------------------------------------------------------------------------
# Driver


SIZES = {"full": {"hidden": 512, "layers": 8, "vocab": 8000, "steps": 6},
         "quick": {"hidden": 256, "layers": 4, "vocab": 8000, "steps": 3}}
METHODS = {"full FT, AdamW": ["peft.method=full", "training.learning_rate=2.0e-5"],
           "LoRA r16": []}  # the kit recipe's LoRA (r16 on all linear layers, lr 2e-4)
LAYOUTS = {"1 process": (1, ["training.gradient_accumulation_steps=2"]),
           "DDP x2": (2, ["distributed.strategy=ddp"]),
           "FSDP x2": (2, ["distributed.strategy=fsdp"])}
# glibc keeps freed heap memory resident, and its mmap threshold grows (up to 32 MiB) as large blocks are freed:
# FSDP's per-layer gather and reduce buffers then come from the heap and the RSS stays high. A fixed threshold
# serves every block of 1 MiB or more with mmap and gives it back at free.
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
MMAP_LABEL = "glibc mmap threshold 1 MiB"


def build_model_fixture(kit: Path, hidden: int, layers: int, vocab: int) -> Path:
    """The kit's fixture at this size, with the prompt/completion rows bench/compare_trl.py trains on (the
    kit's rows and tokenizer do not depend on the model's size)."""
    from compare_trl import ROOT, build_fixture, run_json

    data = build_fixture(kit, 32000)
    fixture = ROOT / "build" / "bench" / f"fixture-h{hidden}-l{layers}-v{vocab}"
    if not (fixture / "model" / "config.json").is_file():
        print(f"building the kit's fixture (hidden {hidden}, {layers} layers, vocab {vocab}) in {fixture} ...",
              flush=True)
        run_json([sys.executable, str(kit / "fixture.py"), str(fixture), "--hidden", str(hidden), "--layers",
                  str(layers), "--vocab", str(vocab)])
    (fixture / "prompt-completion.jsonl").write_bytes((data / "prompt-completion.jsonl").read_bytes())
    return fixture


def parameter_count(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    h, i, v, n = (config["hidden_size"], config["intermediate_size"], config["vocab_size"],
                  config["num_hidden_layers"])
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    return 2 * v * h + h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)  # untied head; q,o; k,v; mlp; norms


def launch_command(processes: int, result_dir: Path, gpupoor_args: list[str]) -> list[str]:
    script = str(Path(__file__).resolve())
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(processes)] if processes > 1 else [sys.executable]
    return [*launcher, script, WORKER_FLAG, str(result_dir), *gpupoor_args]


def run_config(fixture: Path, work: Path, name: str, processes: int, overrides: list[str],
               extra_env: dict[str, str]) -> dict:
    import shutil
    import statistics
    import subprocess

    from compare_trl import ROOT, gpupoor_recipe

    slug = "".join(c if c.isalnum() else "_" for c in name)
    run_dir, result_dir = work / f"run-{slug}", work / f"rss-{slug}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(result_dir, ignore_errors=True)
    sets = [arg for item in overrides for arg in ("--set", item)]
    command = launch_command(processes, result_dir, ["train", str(gpupoor_recipe(fixture, "packed")),
                                                     "--output-dir", str(run_dir), *sets])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **extra_env}
    started = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    ranks = sorted((json.loads(p.read_text()) for p in result_dir.glob("rank-*.json")), key=lambda r: r["rank"])
    if out.returncode != 0 or len(ranks) != processes or any(r["exit_code"] not in (0, None) for r in ranks):
        raise SystemExit(f"{name} failed (exit {out.returncode}, {len(ranks)} of {processes} processes reported):\n"
                         f"{' '.join(command)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    if any("train_peak_rss_mb" not in r for r in ranks):
        print(f"warning: {name}: the training-loop hook did not fire (gpupoor.train.loop.train moved?); only "
              "the whole-run peak and the RSS at exit are measured", flush=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    timed = steps[1:] if len(steps) > 2 else steps  # the first step also allocates the optimizer's state
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the full model's checkpoints are large
    shown = [f"{key}={value}" for key, value in extra_env.items()] + command
    return {"command": shown, "wall_s": wall, "steps": len(steps), "tokens": sum(s["tokens"] for s in steps),
            "median_step_s": statistics.median(s["step_s"] for s in timed), "train_s": steps[-1]["elapsed_s"],
            "loss": steps[-1]["loss"], "ranks": ranks}


def measure(fixture: Path, work: Path, configs: dict, rounds: int) -> tuple[dict, list[str]]:
    from methods import gflops

    results: dict[str, list[dict]] = {name: [] for name in configs}
    notes, best = [], 0.0
    for round_index in range(rounds):
        for name, (processes, overrides, extra_env) in configs.items():  # alternate them within every round
            for attempt in range(2):
                before = gflops()
                result = run_config(fixture, work, name, processes, overrides, extra_env)
                after = gflops()
                best = max(best, before, after)
                result.update(gflops_before=before, gflops_after=after)
                if min(before, after) >= 0.8 * best:
                    break
                notes.append(f"{name} round {round_index + 1}: matmul fell to {min(before, after):.0f} GFLOP/s "
                             f"(best {best:.0f}); {'repeated' if attempt == 0 else 'kept, marked'}")
                result["noisy"] = attempt == 1
            results[name].append(result)
            if round_index == 0:
                print("  $ " + " ".join(result["command"]), flush=True)
            print(f"round {round_index + 1} {name}: wall {result['wall_s']:.1f} s, step "
                  f"{result['median_step_s']:.2f} s, peak RSS {_per_rank(result['ranks'], 'peak_rss_mb')} MiB, "
                  f"in the loop {_per_rank(result['ranks'], 'train_peak_rss_mb')} MiB, loss {result['loss']:.4f}, "
                  f"{before:.0f}/{after:.0f} GFLOP/s", flush=True)
    return results, notes


def _per_rank(ranks: list[dict], key: str) -> str:
    return " / ".join("-" if r.get(key) is None else f"{r[key]:.0f}" for r in ranks)


def render(results: dict, notes: list[str], rounds: int, command: str, setting: str) -> str:
    import platform
    import statistics

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def med_ranks(runs: list[dict], key: str) -> str:
        cells = []
        for rank in range(len(runs[0]["ranks"])):
            values = [r["ranks"][rank].get(key) for r in runs]
            values = [v for v in values if v is not None]
            cells.append(f"{statistics.median(values):.0f}" if values else "-")
        return " / ".join(cells)

    lines = ["### Several processes on one CPU machine: 1 process vs DDP x2 vs FSDP x2", "",
             f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}. "
             f"{setting} Medians of {rounds} alternating round(s); memory figures are per process (rank 0 / "
             "rank 1), each process's own. Whole-run peak = ru_maxrss at exit (loading the full model and the "
             "final save included); load = the peak before the training loop (the whole model is loaded on every "
             "process, then FSDP shards it); loop = the peak inside the training loop (high-water mark reset when "
             "the loop starts: the steady state with optimizer state, gradients and activations); exit = VmRSS at "
             "exit (after the final checkpoint and weights). Median step = rank 0's median step_s in "
             "metrics.jsonl, the first step left out; wall = the whole command, launcher included. GFLOP/s = "
             "fp32 matmul probe just before / after each run.", "",
             "**Timings are only valid when nothing else runs on the machine** (the memory figures do not depend "
             "on that).", "",
             "| configuration | processes | peak RSS MiB (whole run) | load peak MiB | loop peak MiB | RSS at exit "
             "MiB | wall s | median step s | final loss | GFLOP/s before / after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        lines.append(f"| {name} | {len(runs[0]['ranks'])} | {med_ranks(runs, 'peak_rss_mb')} | "
                     f"{med_ranks(runs, 'load_peak_rss_mb')} | {med_ranks(runs, 'train_peak_rss_mb')} | "
                     f"{med_ranks(runs, 'rss_at_exit_mb')} | {med(runs, 'wall_s'):.1f} | "
                     f"{med(runs, 'median_step_s'):.2f} | {med(runs, 'loss'):.4f} | "
                     f"{med(runs, 'gflops_before'):.0f} / {med(runs, 'gflops_after'):.0f} |")
    lines += ["", "Every round (wall s; whole-run peak MiB per rank; loop peak MiB per rank; steps, tokens): " +
              "; ".join(f"{name} " + ", ".join(
                  f"{r['wall_s']:.1f} s {_per_rank(r['ranks'], 'peak_rss_mb')} MiB loop "
                  f"{_per_rank(r['ranks'], 'train_peak_rss_mb')} MiB ({r['steps']} steps, {r['tokens']} tokens)"
                  f"{' [noisy]' if r.get('noisy') else ''}" for r in runs) for name, runs in results.items())]
    if notes:
        lines += ["", "Noisy runs: " + "; ".join(notes)]
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_trl import ROOT

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke check: a tinier model "
                        f"(hidden {SIZES['quick']['hidden']}, {SIZES['quick']['layers']} layers), "
                        f"{SIZES['quick']['steps']} steps, 1 round")
    parser.add_argument("--lora", action="store_true", help="also LoRA r16 on the same model, in each layout")
    parser.add_argument("--mmap-threshold", action="store_true", help="also each layout with glibc's mmap "
                        "threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_): what the allocator keeps resident")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 6; 3 with --quick)")
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    args = parser.parse_args()
    kit = Path(args.kit)
    if not (kit / "fixture.py").is_file():
        raise SystemExit(f"the peer benchmark kit is not at {kit}: this benchmark builds its model with the kit's "
                         "fixture.py (a clone of gpupoor alone has no kit). Pass --kit PATH if it lives elsewhere.")
    size = SIZES["quick" if args.quick else "full"]
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or size["steps"]
    passed = [a for i, a in enumerate(sys.argv[1:], 1) if a != "--kit" and sys.argv[i - 1] != "--kit"
              and not a.startswith("--kit=")]
    command = "make bench-distributed" if not passed else "python bench/distributed.py " + " ".join(passed)
    print(f"command: {command}")
    load = os.getloadavg()[0]
    print(f"timings are only valid when nothing else runs on the machine (load average now {load:.2f} on "
          f"{os.cpu_count()} cores{'; wait for a quiet machine' if load > 0.5 else ''})", flush=True)

    fixture = build_model_fixture(kit, size["hidden"], size["layers"], size["vocab"])
    cores = len(os.sched_getaffinity(0))
    common = ["training.micro_batch_size=1", f"training.max_steps={steps}"]
    configs = {}
    for method, method_sets in METHODS.items():
        if method.startswith("LoRA") and not args.lora:
            continue
        for layout, (processes, layout_sets) in LAYOUTS.items():
            threads = max(1, cores // processes)
            sets = [*common, *method_sets, *layout_sets, f"training.cpu_threads={threads}"]
            configs[f"{method}, {layout}"] = (processes, sets, {})
            if args.mmap_threshold:
                configs[f"{method}, {layout}, {MMAP_LABEL}"] = (processes, sets, MMAP_ENV)
    params = parameter_count(fixture / "model")
    setting = (f"Model: the kit's fixture.py at hidden {size['hidden']}, {size['layers']} layers, vocab "
               f"{size['vocab']} ({params / 1e6:.1f}M parameters, fp32); {steps} optimizer steps of 2 packed rows "
               "of 512 tokens (micro batch 1 on each of 2 processes, or 1 x accumulation 2 on one), gradient "
               "checkpointing on; full FT at lr 2e-5 (AdamW state sharded by FSDP); "
               f"{cores // 2 or 1} thread(s) per process with 2 processes, {cores} with 1."
               + (f" Rows with '{MMAP_LABEL}' run under MALLOC_MMAP_THRESHOLD_={2**20}: glibc then serves every "
                  "allocation of 1 MiB or more with mmap and unmaps it at free, instead of keeping freed heap "
                  "memory resident." if args.mmap_threshold else ""))
    print(setting, flush=True)
    work = ROOT / "build" / "bench" / "distributed"
    work.mkdir(parents=True, exist_ok=True)
    results, notes = measure(fixture, work, configs, rounds)
    body = render(results, notes, rounds, command, setting)
    (work / "results.json").write_text(json.dumps({"command": command, "setting": setting, "results": results,
                                                   "notes": notes}, indent=1))
    print()
    print(body)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == WORKER_FLAG:
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
