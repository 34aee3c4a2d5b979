"""The time plan (issue #43) against measured runs on this CPU: fit its coefficients on the calibration recipes,
then check the accuracy recipes (none of them calibration ones) end to end.

    python bench/time_accuracy.py --calibrate [--threads 1,2]   # runs CALIBRATION, prints COEFFICIENTS to paste
    python bench/time_accuracy.py --calibrate-grpo [--threads 2]   # GRPO_CALIBRATION: the sampling terms alone
    python bench/time_accuracy.py --accuracy [--threads 1,2] [--write]   # runs ACCURACY, the table (docs)

Each run is `gpupoor train RECIPE --set training.cpu_threads=N` in a fresh process, one at a time, with nothing
else running; measured: the step times metrics.jsonl records (median of the steps after the first) and the whole
process's wall time; predicted: `gpupoor plan RECIPE --threads N --json`'s time plan, made before the run (the
plan's facts cache is cleared first, so the plan probes as a first plan would, and no measured step time is
used). The matmul probe (bench/machine.py) runs around each run; a run where it fell more than 25% below the
session's best is run again (once).

Models: random-weight Llamas with the real SmolLM2's tokenizer (bench/plan_accuracy.py's deep models), the real
SmolLM2-135M (dequantized from its GGUF: `make fetch-real`), and the built-in demo model."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import read_metrics  # noqa: E402
from machine import ROOT, write_recipe, write_section  # noqa: E402

import plan_accuracy  # noqa: E402

WORK = ROOT / "build" / "time-bench"
DATA = ROOT / "recipes" / "data"
REAL_RECIPE = ROOT / "recipes" / "smollm2-iso-dates.yaml"


def deep(model: str, steps: int, **keys) -> dict:
    """The real demo's recipe (chat, packed 8 x 128, LoRA r16 on every linear, fp32) on a deep random model."""
    return {"extends": str(REAL_RECIPE), "model.name_or_path": str(plan_accuracy.WORK / model),
            "data.path": str(DATA / "iso-dates-train.jsonl"), "data.eval_path": None, "precision": "fp32",
            "training.max_steps": steps, "training.epochs": None, "logging.progress": "none", **keys}


REAL_MODEL = "<the real model, dequantized>"  # resolved when a recipe is written: importing needs no model
REAL_GGUF = Path("~/.cache/gpupoor/real/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()  # make fetch-real


def real(steps: int | None, **keys) -> dict:
    return {"extends": str(REAL_RECIPE), "model.name_or_path": REAL_MODEL,
            "data.path": str(DATA / "iso-dates-train.jsonl"), "data.eval_path": None, "precision": "fp32",
            "training.max_steps": steps, "logging.progress": "none", **keys}


def demo(**keys) -> dict:
    return {"extends": str(ROOT / "recipes" / "demo.yaml"), "data.path": str(DATA / "reverse-train.jsonl"),
            "data.eval_path": None, "training.eval_every_steps": None, "logging.progress": "none", "precision": "fp32",
            **keys}


PAIRS = {"data.path": str(DATA / "iso-dates-pairs.jsonl"), "data.format": "preference", "training.objective": "dpo"}
GRPO_RECIPE = ROOT / "recipes" / "smollm2-grpo.yaml"


def grpo(model: str, steps: int, prompts: int, group: int, new_tokens: int, **keys) -> dict:
    """The real GRPO demo's recipe (recipes/smollm2-grpo.yaml: chat prompts, LoRA r16, exact + regex rewards) with
    `prompts` x `group` answers of `new_tokens` a micro-batch, on `model` (a deep random one: its answers never end
    early, so every one is max_new_tokens long, as the plan counts them)."""
    where = REAL_MODEL if model == REAL_MODEL else str(plan_accuracy.WORK / model)
    return {"extends": str(GRPO_RECIPE), "model.name_or_path": where, "data.path": str(DATA / "grpo-train.jsonl"),
            "data.eval_path": None, "training.eval_every_steps": None, "precision": "fp32",
            "training.max_steps": steps, "training.micro_batch_size": prompts, "grpo.group_size": group,
            "grpo.max_new_tokens": new_tokens, "logging.progress": "none", "logging.every_steps": 1, **keys}


# GRPO's sampling (--calibrate-grpo): the decode terms fitted with every other coefficient kept
GRPO_FREE = ("decode_calls", "decode_steps", "decode_casts")
GRPO_CALIBRATION = {
    "g-24x384-4x4x16": grpo("deep-24x384", 5, 4, 4, 16),
    "g-12x576-2x8x32": grpo("deep-12x576", 5, 2, 8, 32),
    "g-24x384-8x2x8-beta": grpo("deep-24x384", 5, 8, 2, 8, **{"grpo.beta": 0.04}),
    "g-12x576-4x4x16-iter2": grpo("deep-12x576", 7, 4, 4, 16, **{"grpo.iterations": 2}),
    "g-12x576-1x16x24": grpo("deep-12x576", 5, 1, 16, 24),
    "g-24x384-4x4x16-bf16": grpo("deep-24x384", 5, 4, 4, 16, precision="bf16"),
    "g-12x576-2x8x32-bf16": grpo("deep-12x576", 5, 2, 8, 32, precision="bf16"),
}
# Fit: 6 steps each, short; shapes, methods and samplers varied.
CALIBRATION = {
    "c-24x384-8x128": deep("deep-24x384", 6),
    "c-24x384-8x256-ckpt": deep("deep-24x384", 6, **{"data.max_length": 256, "memory.gradient_checkpointing": True}),
    "c-12x576-4x256-random": deep("deep-12x576", 6, **{"data.max_length": 256, "training.micro_batch_size": 4,
                                                       "data.sampler": "random"}),
    "c-12x576-8x128-full": deep("deep-12x576", 6, **{"peft.method": "full"}),
    "c-24x384-8x128-dora": deep("deep-24x384", 6, **{"peft.method": "dora"}),
    "c-12x576-8x128-nf4": deep("deep-12x576", 6, **{"quantization.bits": 4}),
    "c-24x384-4x128-dpo": deep("deep-24x384", 6, **PAIRS, **{"training.micro_batch_size": 4}),
    "c-24x384-8x128-distill": deep("deep-24x384", 6, **{"distill.teacher": str(plan_accuracy.WORK / "deep-12x576")}),
    "c-12x576-2x128-accum4": deep("deep-12x576", 6, **{"training.micro_batch_size": 2,
                                                       "training.gradient_accumulation_steps": 4}),
    "c-24x384-1x128": deep("deep-24x384", 10, **{"training.micro_batch_size": 1}),
    "c-12x576-8x128-dora-ckpt": deep("deep-12x576", 6, **{"peft.method": "dora", "memory.gradient_checkpointing": True}),
    "c-12x576-2x128-dpo": deep("deep-12x576", 6, **PAIRS, **{"training.micro_batch_size": 2}),
    "c-demo-8x128": demo(**{"training.micro_batch_size": 8, "training.max_steps": 60, "training.epochs": None}),
    "c-demo-4x64": demo(**{"training.micro_batch_size": 4, "data.max_length": 64, "training.max_steps": 60,
                           "training.epochs": None}),
    # bf16 (on a CPU with bf16 matrix units): the frozen base in bf16, what trains in fp32
    "c-24x384-8x128-bf16": deep("deep-24x384", 6, precision="bf16"),
    "c-12x576-4x256-random-bf16": deep("deep-12x576", 6, precision="bf16", **{
        "data.max_length": 256, "training.micro_batch_size": 4, "data.sampler": "random"}),
    "c-12x576-8x128-full-bf16": deep("deep-12x576", 6, precision="bf16", **{"peft.method": "full"}),
    "c-12x576-8x128-nf4-bf16": deep("deep-12x576", 6, precision="bf16", **{"quantization.bits": 4}),
    "c-demo-8x128-bf16": demo(precision="bf16", **{"training.micro_batch_size": 8, "training.max_steps": 60,
                                                   "training.epochs": None}),
}
# Accuracy: whole runs, end to end (start-up, every step, the saves, final/).
ACCURACY = {
    "real-lora-8x128": ("the real SmolLM2-135M, the demo's recipe (packed 8 x 128, LoRA r16)", real(16)),
    "real-qlora-8x128": ("real SmolLM2-135M, NF4 base (QLoRA)", real(10, **{"quantization.bits": 4})),
    "real-lora-ckpt-padded": ("real SmolLM2-135M, checkpointing, padded batches (random sampler)",
                              real(10, **{"memory.gradient_checkpointing": True, "data.sampler": "random"})),
    "real-full-4x128": ("real SmolLM2-135M, full fine-tuning, micro-batch 4",
                        real(8, **{"peft.method": "full", "training.micro_batch_size": 4})),
    "real-dora": ("real SmolLM2-135M, DoRA", real(8, **{"peft.method": "dora"})),
    "real-dora-ckpt": ("real SmolLM2-135M, DoRA with checkpointing",
                       real(8, **{"peft.method": "dora", "memory.gradient_checkpointing": True})),
    "16x768-distill": ("a 16 x 768 student distilled from the 24 x 384 teacher",
                       deep("deep-16x768", 10, **{"distill.teacher": str(plan_accuracy.WORK / "deep-24x384")})),
    "16x768-dpo": ("DPO on iso-date pairs, a 16 x 768 model, 4 pairs a micro-batch",
                   deep("deep-16x768", 10, **PAIRS, **{"training.micro_batch_size": 4})),
    "demo": ("the tiny built-in demo (recipes/demo.yaml, 3 epochs, padded batches of 16)", demo()),
    "real-lora-8x128-bf16": ("the real SmolLM2-135M, the demo's recipe, bf16", real(16, precision="bf16")),
    "real-qlora-8x128-bf16": ("real SmolLM2-135M, NF4 base (QLoRA), bf16",
                              real(10, precision="bf16", **{"quantization.bits": 4})),
    "real-full-4x128-bf16": ("real SmolLM2-135M, full fine-tuning, micro-batch 4, bf16",
                             real(8, precision="bf16", **{"peft.method": "full", "training.micro_batch_size": 4})),
    "16x768-distill-bf16": ("the 16 x 768 student distilled, bf16", deep("deep-16x768", 10, precision="bf16", **{
        "distill.teacher": str(plan_accuracy.WORK / "deep-24x384")})),
    "demo-bf16": ("the tiny built-in demo, bf16", demo(precision="bf16")),
    "16x768-grpo": ("GRPO, a 16 x 768 model, 4 prompts x 4 answers of 16 tokens",
                    grpo("deep-16x768", 6, 4, 4, 16)),
    "16x768-grpo-ckpt-beta": ("GRPO with checkpointing (whole answer rows) and beta 0.04, 16 x 768",
                              grpo("deep-16x768", 6, 2, 4, 16, **{"memory.gradient_checkpointing": True,
                                                                  "grpo.beta": 0.04})),
    "real-grpo": ("the real GRPO demo's recipe, 8 steps (answers end early; the plan takes them halfway to 16 tokens)",
                  grpo(REAL_MODEL, 8, 4, 4, 16)),
    "real-grpo-bf16": ("the real GRPO demo's recipe, 8 steps, bf16", grpo(REAL_MODEL, 8, 4, 4, 16, precision="bf16")),
    # issue #57's first row: the real model as users name it (its GGUF, dequantized at every start), chat rows
    # packed to 256, LoRA r8, micro-batch 4
    "real-gguf-r8-4x256": ("the real SmolLM2-135M from its GGUF, packed 4 x 256, LoRA r8, 8 steps",
                           real(8, **{"model.name_or_path": str(REAL_GGUF), "data.max_length": 256,
                                      "training.micro_batch_size": 4, "peft.rank": 8})),
}


def recipe(name: str, settings: dict) -> Path:
    if settings.get("model.name_or_path") == REAL_MODEL:
        from gpupoor.model.pretrained import dequantized_copy, real_model_path

        settings = {**settings, "model.name_or_path": str(dequantized_copy(real_model_path()))}
    return write_recipe(WORK / "recipes" / f"{name}.yaml", settings)


def forget_measured_steps(probes: bool = False) -> None:
    """The plan must use no step time a train measured (training records them in the cache): it predicts. With
    `probes`, no step probe either: the plan measures the recipe as a first plan does."""
    facts = WORK / "cache" / "time-facts.json"
    if facts.is_file():
        cached = json.loads(facts.read_text())
        for machine in cached.get("machines", {}).values():
            machine.pop("steps", None)
            if probes:
                machine.pop("probes", None)
        facts.write_text(json.dumps(cached))


def run(name: str, settings: dict, threads: int) -> dict:
    from machine import gflops

    path = recipe(name, settings)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GPUPOOR_CACHE": str(WORK / "cache")}
    forget_measured_steps(probes=True)
    first = gflops(threads)  # the plan's probe is as exposed to a busy machine as the run
    plan_started = time.perf_counter()
    planned = subprocess.run([sys.executable, "-m", "gpupoor", "plan", str(path), "--json", "--threads",
                              str(threads)], capture_output=True, text=True, env=env)
    plan_s = time.perf_counter() - plan_started
    plan = json.loads(planned.stdout)
    if "time" not in plan:
        raise SystemExit(f"{name}: no time plan: {plan.get('time_error')}\n{planned.stderr}")
    before = gflops(threads)
    run_dir = WORK / "runs" / f"{name}-t{threads}"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpupoor", "train", str(path), "--output-dir", str(run_dir),
                           "--set", f"training.cpu_threads={threads}"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    after = gflops(threads)
    if done.returncode != 0:
        raise SystemExit(f"{name}: train failed\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    start, steps = read_metrics(run_dir)
    step_s = [s["step_s"] for s in steps]
    # GRPO sampling every N steps: the mean over whole cycles (a median would pick one kind of step)
    typical = statistics.fmean if settings.get("grpo.iterations", 1) > 1 else statistics.median
    return {"name": name, "threads": threads, "wall_s": wall, "step_s": step_s,
            "measured_step_s": typical(step_s[1:]) if len(step_s) > 1 else step_s[0],
            "startup_s": start.get("startup_s"), "plan": plan["time"], "gflops": [first, before, after], "plan_s": plan_s}


# A row counts when the matmul probes around its plan and its run all read at least QUIET_SHARE of the best this
# session saw (docs/benchmarks.md: a quiet run and a contended one never share a table); else it runs again.
QUIET_SHARE = 0.85
QUIET_ATTEMPTS = 3


def run_all(table: dict, threads: list[int], out: Path, only: list[str], keep_fastest: bool = False) -> list[dict]:
    """Run `table`'s recipes (those in `only`, when given) at each thread count. Earlier results of other recipes or
    thread counts stay; a row run again replaces its old one, or with `keep_fastest` only when it ran faster (a
    busy machine only ever slows a run: of two, the faster is the less disturbed)."""
    plan_accuracy.build_deep_models()
    best: dict = {}
    earlier = json.loads(out.read_text()) if out.is_file() else []
    again = [r for r in earlier if (not only or r["name"] in only) and r["threads"] in threads and r["name"] in table]
    results = [r for r in earlier if r not in again]
    before = {(r["name"], r["threads"]): r for r in again} if keep_fastest else {}
    for name, entry in table.items():
        if only and name not in only:
            continue
        settings = entry[1] if isinstance(entry, tuple) else entry
        for n in threads:
            for attempt in range(QUIET_ATTEMPTS):
                row = run(name, settings, n)
                best[n] = max(best.get(n, 0), *row["gflops"])
                if min(row["gflops"]) >= QUIET_SHARE * best[n] or attempt == QUIET_ATTEMPTS - 1:
                    break
                print(f"  {name} t{n}: probe fell to {min(row['gflops']):.0f} of {best[n]:.0f} GFLOP/s: again")
            previous = before.get((name, n))
            if previous is not None and previous["measured_step_s"] < row["measured_step_s"]:
                print(f"  {name} t{n}: {row['measured_step_s']:.3f} s a step, slower than the earlier run's "
                      f"{previous['measured_step_s']:.3f} s: the earlier one kept")
                row = previous
            results.append(row)
            t = row["plan"]
            print(f"{name:26s} t{n} step {row['measured_step_s']:.3f} s (plan {t['step_s']:.3f}, "
                  f"{t['step_s'] / row['measured_step_s'] - 1:+.0%})  total {row['wall_s']:.1f} s (plan "
                  f"{t['total_s']:.1f}, {t['total_s'] / row['wall_s'] - 1:+.0%})", flush=True)
            out.write_text(json.dumps(results, indent=1))
    return results


def replanned(r: dict) -> dict:
    """The run's time plan made again with the code as it is now (the facts are cached: no probe), so a change to
    the work terms is fitted without training again."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GPUPOOR_CACHE": str(WORK / "cache")}
    forget_measured_steps()
    done = subprocess.run([sys.executable, "-m", "gpupoor", "plan", str(WORK / "recipes" / f"{r['name']}.yaml"),
                           "--json", "--threads", str(r["threads"])], capture_output=True, text=True, env=env)
    return json.loads(done.stdout)["time"]


def unit_seconds(plan: dict) -> dict:
    """Each kind's work in a planned step, in seconds at coefficient 1 (its amount at its measured rate)."""
    from gpupoor.plan.time.work import KINDS
    from gpupoor.plan.time.estimate import Rates

    rates = Rates(**plan["rates"])
    seconds = dict.fromkeys(KINDS, 0.0)
    for w in plan["work"]:
        seconds[w["kind"]] += w["amount"] * rates.unit_s(w["kind"])
    return seconds


def fit(results: list[dict], free: tuple[str, ...] | None = None) -> dict:
    """Least squares of the relative step-time error: step = sum_k c_k amount_k / rate_k (the rate measured for
    that kind of work; a call's seconds times the calls) + c_mb * micro-batches + c_step. `free`: fit only these
    coefficients, every other one kept at its value in COEFFICIENTS (what the step takes beyond them is fixed)."""
    import numpy as np

    from gpupoor.plan.time.work import KINDS
    from gpupoor.plan.time.estimate import COEFFICIENTS

    names = [*KINDS, "micro_batch_s", "step_s"]
    current = COEFFICIENTS["cpu"]
    free_index = [names.index(n) for n in free] if free else list(range(len(names)))
    rows, target = [], []
    for r in results:
        plan = r["plan"] = replanned(r)
        seconds = unit_seconds(plan)
        features = [*seconds.values(), plan["accumulation"], 1.0]
        scale = 1 / r["measured_step_s"]
        fixed = sum(current[n] * f for i, (n, f) in enumerate(zip(names, features)) if i not in free_index)
        rows.append([features[i] * scale for i in free_index])
        target.append(1.0 - fixed * scale)
    a, b = np.array(rows), np.array(target)
    names = [names[i] for i in free_index]
    keep = list(range(len(names)))
    while True:  # non-negative: drop what fits negative, solve again
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all():
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0]
    fitted = dict.fromkeys(names, 0.0)
    fitted.update({names[k]: float(c) for k, c in zip(keep, coef)})
    return fitted


GPU_FREE = ("matmul", "dequantize")  # what the few GPU rows can fit
# The rest: the CPU's coefficients, but a module call costs a kernel launch on a GPU (~10 us, not the CPU's
# dispatch and compute), no fixed part the few rows could tell from the matmuls', and elementwise work at the
# H100's memory bandwidth: 3.35 TB/s moves ~0.84e12 bf16 values in and out a second, about three kernels a value,
# against the on-paper matmul rate of 742 TFLOP/s (0.75 x 989.4): 742 / 0.84 x 3 = 2650 (the rows cannot tell
# it from the matmuls: both grow with tokens x layers).
GPU_FIXED = {"calls": 1e-5, "step_s": 0.0, "micro_batch_s": 0.0, "elementwise": 2650.0, "casts": 0.0}


def calibrate_gpu(folder: Path) -> dict:
    """The cuda coefficients from the timed rows a lent GPU measured (bench/gpu.py mfu|times|flagship): each row's
    recipe planned here on paper for that GPU (`--device cuda --gpu H100`: its published peak x
    PAPER_PROBE_FRACTION), its settled step time measured there; the coefficients in GPU_FREE fitted by least
    squares of the relative error, the others at GPU_FIXED or the CPU's (the few GPU rows cannot pin them down)."""
    import numpy as np

    import gpu as gpu_bench
    from gpupoor.plan.time.estimate import COEFFICIENTS

    cpu = {**COEFFICIENTS["cpu"], **GPU_FIXED}
    rows, fixed_part, measured, names = [], [], [], []
    for file in ("gpu-mfu.json", "gpu-times.json", "gpu-flagship.json"):
        for row in json.loads((folder / file).read_text())["rows"]:
            if "error" in row or row["env"]:
                continue
            path = gpu_bench.recipe(row["arch"], row["name"], {**row["keys"], "training.max_steps": 12})
            done = subprocess.run([sys.executable, "-m", "gpupoor", "plan", str(path), "--json", "--device", "cuda",
                                   "--gpu", "H100"], capture_output=True, text=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "GPUPOOR_CACHE": str(WORK / "cache")})
            plan = json.loads(done.stdout)["time"]
            amounts = {**unit_seconds(plan), "micro_batch_s": plan["accumulation"], "step_s": 1.0}
            amounts["matmul"] += amounts.pop("recompute")  # too few GPU rows with checkpointing to tell them apart
            rows.append([amounts[k] for k in GPU_FREE])
            fixed_part.append(sum(cpu[k] * v for k, v in amounts.items() if k not in GPU_FREE))
            measured.append(row["settled_step_s"])
            names.append(row["name"])
    a = np.array(rows) / np.array(measured)[:, None]
    b = 1 - np.array(fixed_part) / np.array(measured)
    keep = list(range(len(GPU_FREE)))
    while True:  # non-negative: drop what fits negative (at 0), solve again
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all():
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0]
    fitted = {**cpu, **dict.fromkeys(GPU_FREE, 0.0), **{GPU_FREE[k]: float(c) for k, c in zip(keep, coef)}}
    fitted["recompute"] = fitted["matmul"]
    for name, features, rest, step in zip(names, rows, fixed_part, measured):
        predicted = rest + sum(fitted[k] * f for k, f in zip(GPU_FREE, features))
        print(f"{name:24s} measured {step:.3f} s  fitted {predicted:.3f} s ({predicted / step - 1:+.0%})")
    return fitted


def table(results: list[dict]) -> str:
    """One row a run. With the plan's range (a measured plan): the total's likely range and whether the run fell in
    it, and how long the first plan took (measuring included)."""
    ranged = all("total_range_s" in r["plan"] for r in results)
    extra = " total s likely | in range | first plan s | matmul GFLOP/s around |" if ranged else ""
    lines = ["| recipe | what | threads | step s measured | step s planned | error | total s measured | "
             "total s planned | error |" + extra, "|---|---|---:|---:|---:|---:|---:|---:|---:|"
             + ("---:|---|---:|---:|" if ranged else "")]
    for r in results:
        t = r["plan"]
        what = ACCURACY[r["name"]][0] if r["name"] in ACCURACY else "calibration"
        row = (f"| {r['name']} | {what} | {r['threads']} | {r['measured_step_s']:.3f} | {t['step_s']:.3f} | "
               f"{t['step_s'] / r['measured_step_s'] - 1:+.1%} | {r['wall_s']:.1f} | {t['total_s']:.1f} | "
               f"{t['total_s'] / r['wall_s'] - 1:+.1%} |")
        if ranged:
            low, high = t["total_range_s"]
            plan_s = f"{r['plan_s']:.0f}" if "plan_s" in r else "-"
            probes = r.get("gflops") or [0]
            row += (f" {low:.0f}-{high:.0f} | {'yes' if low <= r['wall_s'] <= high else 'no'} | {plan_s} | "
                    f"{min(probes):.0f}-{max(probes):.0f} |")
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--calibrate-grpo", action="store_true", help="fit GRPO's sampling terms alone")
    parser.add_argument("--calibrate-gpu", type=Path, help="a folder of bench/gpu.py's timed JSON from a GPU")
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--only", default="")
    parser.add_argument("--reuse", action="store_true", help="fit or tabulate the last results, run nothing")
    parser.add_argument("--keep-fastest", action="store_true",
                        help="a recipe run again keeps the faster of its two runs (the less disturbed)")
    parser.add_argument("--write", action="store_true", help="--accuracy: the table into docs/benchmarks.md")
    args = parser.parse_args()
    threads = [int(n) for n in args.threads.split(",")]
    only = [n for n in args.only.split(",") if n]
    WORK.mkdir(parents=True, exist_ok=True)
    if args.calibrate_gpu:
        print(json.dumps(calibrate_gpu(args.calibrate_gpu.resolve()), indent=1))
    if args.calibrate:
        out = WORK / "calibration.json"
        results = json.loads(out.read_text()) if args.reuse else run_all(CALIBRATION, threads, out, only)
        print(json.dumps(fit(results), indent=1))
        print(table(results))
    if args.calibrate_grpo:
        out = WORK / "calibration-grpo.json"
        results = json.loads(out.read_text()) if args.reuse else \
            run_all(GRPO_CALIBRATION, threads, out, only, args.keep_fastest)
        print(json.dumps(fit(results, GRPO_FREE), indent=1))
        print(table(results))
    if args.accuracy:
        out = WORK / "accuracy.json"
        if args.reuse:  # predicted again with the code and coefficients as they are now; the measurements stay
            results = json.loads(out.read_text())
            for r in results:
                if not only or r["name"] in only:
                    r["plan"] = replanned(r)
            out.write_text(json.dumps(results, indent=1))
        else:
            results = run_all(ACCURACY, threads, out, only, args.keep_fastest)
        print(table(results))
        if args.write:
            write_tables(results, only)


def write_tables(results: list[dict], only: list[str]) -> None:
    """docs/benchmarks.md's two accuracy tables: the SFT, DPO and distillation rows, and GRPO's; with `only`, just
    the tables those rows are in (the other's rows keep the figures they were written with)."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
                 "unknown CPU")
    command = "python bench/time_accuracy.py --accuracy --write"
    # the measured plan's tables, one a kind of CPU (issue #57): an AMD EPYC's and an Intel Xeon's
    kind = "epyc" if "EPYC" in model else "xeon" if "Xeon" in model else "other"
    for key, rows in ((f"time-accuracy-{kind}", [r for r in results if "grpo" not in r["name"]]),
                      (f"time-accuracy-grpo-{kind}", [r for r in results if "grpo" in r["name"]])):
        if rows and (not only or any(r["name"] in only for r in rows)):
            write_section(ROOT / "docs" / "benchmarks.md", key,
                          f"Measured {time.strftime('%Y-%m-%d')} on {model} ({os.cpu_count()} cores), torch CPU "
                          f"wheel. Command: `{command}` (`--reuse`: predicted again, the measurements kept; "
                          f"`--only A,B`: those rows).\n\n{table(rows)}")


if __name__ == "__main__":
    main()
