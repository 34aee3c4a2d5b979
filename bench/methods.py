"""Peak memory and time of each training method, and of distillation with the fused vs the plain KL, on the
peer kit's offline fixture (the same model and data as bench/compare_trl.py).

Each configuration is a fresh `gpupoor train` process under the kit's measure.py (wall seconds, peak RSS); the
configurations alternate within every round (the machines are noisy) and the medians, with their min-max, go
into docs/benchmarks.md with the command. Every run is bracketed by bench/machine.py's probe (a 2048 x 2048 fp32
matmul, GFLOP/s): a run whose lower probe fell more than 10% below the session's best is rejected and repeated
(3 attempts, the last kept and marked noisy); the tables list those runs.

    python bench/methods.py [--rounds 3] [--rows 160] [--kit ../shared/bench] [--only methods|distill]

About 5 minutes for the methods and 7 for distillation at 3 rounds on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import (REFERENCE_ROWS, ROOT, SETTINGS, build_fixture, gpupoor_recipe,  # noqa: E402
                         measured_run)
from machine import Steady, gflops, run_table_rows, shown_command, spread, write_section  # noqa: E402, F401 (gflops: distributed.py)

METHODS = {  # label -> --set overrides on the kit's LoRA recipe (packed, checkpointing, fp32, r16)
    "LoRA r16": [],
    "DoRA r16": ["peft.method=dora"],
    "IA3": ["peft.method=ia3"],
    "LoRA r16, last 2 of 4 layers": ["peft.last_layers=2"],
    "full, AdamW": ["peft.method=full", "training.learning_rate=2.0e-5"],
    "full, 8-bit AdamW": ["peft.method=full", "training.learning_rate=2.0e-5", "training.optimizer=adamw_8bit"],
}
DISTILL = {  # teacher = the fixture's own model (same tokenizer); student LoRA r16
    "distill, fused KL": [],
    "distill, plain KL (full logits)": ["memory.fused_cross_entropy=false"],
}


def run_config(kit: Path, fixture: Path, name: str, overrides: list[str]) -> dict:
    run_dir = fixture / f"run-{name.replace(' ', '_').replace(',', '')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [arg for item in overrides for arg in ("--set", item)]
    recipe = gpupoor_recipe(fixture, "packed")
    measured = measured_run(kit, [str(ROOT / ".venv" / "bin" / "gpupoor"), "train", str(recipe), "--output-dir",
                                  str(run_dir), *sets])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"train_s": steps[-1]["elapsed_s"], "wall_s": measured["seconds"], "peak_rss_mb": measured["peak_rss_mb"],
            "tokens_per_s": sum(s["tokens"] for s in steps) / steps[-1]["elapsed_s"], "loss": steps[-1]["loss"]}


def measure(kit: Path, fixture: Path, configs: dict[str, list[str]], rounds: int,
            steady: Steady) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for round_index in range(rounds):
        for name, overrides in configs.items():
            result = steady.run(f"{name}, round {round_index + 1}",
                                lambda name=name, overrides=overrides: run_config(kit, fixture, name, overrides))
            results[name].append(result)
            print(f"round {round_index + 1} {name}: train {result['train_s']:.1f} s, wall {result['wall_s']:.1f} s, "
                  f"{result['peak_rss_mb']:.0f} MB, GFLOP/s {result['gflops_before']:.0f}/"
                  f"{result['gflops_after']:.0f}{' (noisy)' if result['noisy'] else ''}", flush=True)
    return results


def render(title: str, note: str, results: dict, steady: Steady, rounds: int, command: str) -> str:
    lines = [f"### {title}", "", f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), "
             f"{time.strftime('%Y-%m-%d')}. {note} Median (min-max) of {rounds} alternating rounds. "
             + steady.summary(), "",
             "| configuration | train s | wall s | peak RSS MB | real tokens/s | final loss | GFLOP/s before | "
             "GFLOP/s after |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += run_table_rows(results)
    notes = steady.notes()
    if notes:
        lines += ["", "Runs the probe flagged:", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=REFERENCE_ROWS, help="the fixture's alpaca rows")
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to write into")
    parser.add_argument("--only", choices=("methods", "distill"), default=None)
    args = parser.parse_args()
    kit = Path(args.kit)
    if not (kit / "fixture.py").is_file():
        raise SystemExit(f"the peer benchmark kit is not at {kit}: this benchmark uses its fixture (a clone of "
                         "gpupoor alone has no kit). Pass --kit PATH if it lives elsewhere.")
    command = shown_command("bench/methods.py", sys.argv[1:])
    doc = Path(args.doc)
    if args.only in (None, "methods"):
        fixture = build_fixture(kit, 32000, args.rows)
        steady = Steady()
        steady.warm_up()
        results = measure(kit, fixture, METHODS, args.rounds, steady)
        body = render("Training methods on the fixture (vocab 32000, CPU, fp32)",
                      f"One epoch over {args.rows} rows, micro batch {SETTINGS['batch']} packed rows of "
                      f"{SETTINGS['seq']} tokens, gradient checkpointing on; LoRA/DoRA rank 16 on all linear layers; "
                      "full fine-tuning at lr 2e-5.", results, steady, args.rounds, command)
        write_section(doc, "methods", body)
        print(body)
    if args.only in (None, "distill"):
        fixture = build_fixture(kit, 152064, args.rows)
        configs = {name: [f"distill.teacher={fixture / 'model'}", "distill.weight=0.5", *extra]
                   for name, extra in DISTILL.items()}
        steady = Steady()
        steady.warm_up()
        results = measure(kit, fixture, configs, args.rounds, steady)
        body = render("Distillation at vocabulary 152064: fused vs plain KL (CPU, fp32)",
                      f"Student: the fixture's model with LoRA r16; teacher: the same model, frozen (same tokenizer); "
                      f"KL weight 0.5, T 2; one epoch over {args.rows} rows, packed micro batches, checkpointing on. "
                      "The plain KL holds both models' full logits.", results, steady, args.rounds, command)
        write_section(doc, "distill", body)
        print(body)


if __name__ == "__main__":
    main()
