"""Peak memory and time of each training method, and of distillation with the fused vs the plain KL, on the
peer kit's offline fixture (the same model and data as bench/compare_trl.py).

Each configuration is a fresh `gpupoor train` process under the kit's measure.py (wall seconds, peak RSS); the
configurations alternate within every round (the machines are noisy) and the medians go into docs/benchmarks.md
with the command. The machine's fp32 matmul GFLOP/s is measured before and after every run; a run where it fell
below 80% of the session's best is repeated once and marked when it still is.

    python bench/methods.py [--rounds 3] [--kit ../shared/bench] [--only methods|distill]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import ROOT, SETTINGS, build_fixture, gpupoor_recipe, run_json, write_section  # noqa: E402

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
GFLOPS_PROBE = ("import time, torch; torch.set_num_threads(%d); a = torch.randn(1024, 1024); b = torch.randn(1024, "
                "1024); [a @ b for _ in range(3)]; n = 20; t = time.perf_counter(); [a @ b for _ in range(n)]; "
                "print(2 * 1024 ** 3 * n / (time.perf_counter() - t) / 1e9)")


def gflops() -> float:
    threads = len(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", GFLOPS_PROBE % threads], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def run_config(kit: Path, fixture: Path, name: str, overrides: list[str]) -> dict:
    run_dir = fixture / f"run-{name.replace(' ', '_').replace(',', '')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [arg for item in overrides for arg in ("--set", item)]
    measured = run_json([sys.executable, str(kit / "measure.py"), str(ROOT / ".venv" / "bin" / "gpupoor"), "train",
                         str(gpupoor_recipe(fixture, "packed")), "--output-dir", str(run_dir), *sets])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"train_s": steps[-1]["elapsed_s"], "wall_s": measured["seconds"], "peak_rss_mb": measured["peak_rss_mb"],
            "tokens_per_s": sum(s["tokens"] for s in steps) / steps[-1]["elapsed_s"], "loss": steps[-1]["loss"]}


def measure(kit: Path, fixture: Path, configs: dict[str, list[str]], rounds: int) -> tuple[dict, list[str]]:
    results: dict[str, list[dict]] = {name: [] for name in configs}
    notes, best = [], 0.0
    for round_index in range(rounds):
        for name, overrides in configs.items():
            for attempt in range(2):
                before = gflops()
                result = run_config(kit, fixture, name, overrides)
                after = gflops()
                best = max(best, before, after)
                result["gflops"] = min(before, after)
                if result["gflops"] >= 0.8 * best:
                    break
                notes.append(f"{name} round {round_index + 1}: matmul fell to {result['gflops']:.0f} GFLOP/s "
                             f"(best {best:.0f}); {'repeated' if attempt == 0 else 'kept, marked'}")
            results[name].append(result)
            print(f"round {round_index + 1} {name}: train {result['train_s']:.1f} s, wall {result['wall_s']:.1f} s, "
                  f"{result['peak_rss_mb']:.0f} MB, {result['gflops']:.0f} GFLOP/s", flush=True)
    return results, notes


def render(title: str, note: str, results: dict, notes: list[str], rounds: int, command: str) -> str:
    med = {name: {key: statistics.median(r[key] for r in runs) for key in ("train_s", "wall_s", "peak_rss_mb",
                                                                           "tokens_per_s", "loss", "gflops")}
           for name, runs in results.items()}
    lines = [f"### {title}", "", f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), "
             f"{time.strftime('%Y-%m-%d')}. {note} Medians of {rounds} alternating rounds; matmul GFLOP/s is the "
             "lower of the probes just before and after each run.", "",
             "| configuration | train s | wall s | peak RSS MB | real tokens/s | final loss | GFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    for name, m in med.items():
        lines.append(f"| {name} | {m['train_s']:.1f} | {m['wall_s']:.1f} | {m['peak_rss_mb']:.0f} | "
                     f"{m['tokens_per_s']:.0f} | {m['loss']:.3f} | {m['gflops']:.0f} |")
    lines += ["", "Every round: " + "; ".join(
        f"{name} " + ", ".join(f"{r['train_s']:.1f} s {r['peak_rss_mb']:.0f} MB" for r in runs)
        for name, runs in results.items())]
    if notes:
        lines += ["", "Noisy runs: " + "; ".join(notes)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--only", choices=("methods", "distill"), default=None)
    args = parser.parse_args()
    kit = Path(args.kit)
    if not (kit / "fixture.py").is_file():
        raise SystemExit(f"the peer benchmark kit is not at {kit}: this benchmark uses its fixture (a clone of "
                         "gpupoor alone has no kit). Pass --kit PATH if it lives elsewhere.")
    command = "python bench/methods.py " + " ".join(a for a in sys.argv[1:] if not a.startswith("--kit")
                                                     and a != args.kit)
    doc = ROOT / "docs" / "benchmarks.md"
    if args.only in (None, "methods"):
        fixture = build_fixture(kit, 32000)
        results, notes = measure(kit, fixture, METHODS, args.rounds)
        body = render("Training methods on the fixture (vocab 32000, CPU, fp32)",
                      f"One epoch, micro batch {SETTINGS['batch']} packed rows of {SETTINGS['seq']} tokens, gradient "
                      "checkpointing on; LoRA/DoRA rank 16 on all linear layers; full fine-tuning at lr 2e-5.",
                      results, notes, args.rounds, command)
        write_section(doc, "methods", body)
        print(body)
    if args.only in (None, "distill"):
        fixture = build_fixture(kit, 152064)
        configs = {name: [f"distill.teacher={fixture / 'model'}", "distill.weight=0.5", *extra]
                   for name, extra in DISTILL.items()}
        results, notes = measure(kit, fixture, configs, args.rounds)
        body = render("Distillation at vocabulary 152064: fused vs plain KL (CPU, fp32)",
                      "Student: the fixture's model with LoRA r16; teacher: the same model, frozen (same tokenizer); "
                      "KL weight 0.5, T 2; one epoch, packed micro batches, checkpointing on. The plain KL holds "
                      "both models' full logits.", results, notes, args.rounds, command)
        write_section(doc, "distill", body)
        print(body)


if __name__ == "__main__":
    main()
