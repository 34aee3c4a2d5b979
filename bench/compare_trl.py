"""gpupoor vs the peer (TRL SFTTrainer + peft) on the peer kit's offline fixture, side by side.

Runs the two sides alternately (the machines are noisy), each under the kit's measure.py (wall seconds,
peak RSS of the process), and writes the medians and ratios into docs/benchmarks.md with the command.
Needs the peer kit (../shared/bench by default) and `trl` in the venv (`make bench` installs it).

    python bench/compare_trl.py [--rounds 3] [--vocab 32000] [--kit ../shared/bench]
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

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"batch": 8, "seq": 512, "rank": 16}  # the comparison the issues ask for; gc on both sides


def run_json(command: list[str]) -> dict:
    out = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"failed: {' '.join(command)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def build_fixture(kit: Path, vocab: int) -> Path:
    fixture = ROOT / "build" / "bench" / f"fixture-v{vocab}"
    if not (fixture / "model" / "config.json").is_file():
        print(f"building the kit's fixture in {fixture} ...", flush=True)
        run_json([sys.executable, str(kit / "fixture.py"), str(fixture), "--vocab", str(vocab)])
    # The peer trains on prompt = instruction + "\n" + input + "\n", completion = output: give gpupoor the
    # very same text (its `completion` format), so both sides see the same tokens.
    rows = [json.loads(line) for line in (fixture / "data.jsonl").read_text().splitlines()]
    (fixture / "prompt-completion.jsonl").write_text("".join(
        json.dumps({"prompt": r["instruction"] + "\n" + r["input"] + "\n", "completion": r["output"]}) + "\n"
        for r in rows))
    return fixture


def gpupoor_recipe(fixture: Path, sampler: str) -> Path:
    recipe = fixture / f"gpupoor-{sampler}.yaml"
    recipe.write_text(
        f"model: {{name_or_path: model}}\n"
        f"data: {{path: prompt-completion.jsonl, format: completion, max_length: {SETTINGS['seq']}, sampler: {sampler}}}\n"
        f"peft: {{rank: {SETTINGS['rank']}, alpha: {2 * SETTINGS['rank']}}}\n"
        "precision: fp32\n"
        f"training: {{micro_batch_size: {SETTINGS['batch']}, epochs: 1, learning_rate: 2.0e-4}}\n"
        "memory: {gradient_checkpointing: true}\n"
        "checkpoint: {every_minutes: 1000}\n"
        "logging: {progress: none}\n")
    return recipe


def run_gpupoor(kit: Path, fixture: Path, sampler: str, extra: list[str]) -> dict:
    run_dir = fixture / f"run-{sampler}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [arg for item in extra for arg in ("--set", item)]
    measured = run_json([sys.executable, str(kit / "measure.py"), str(ROOT / ".venv" / "bin" / "gpupoor"), "train",
                         str(gpupoor_recipe(fixture, sampler)), "--output-dir", str(run_dir), *overrides])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    tokens = sum(step["tokens"] for step in steps)
    train_s = steps[-1]["elapsed_s"]
    return {"train_s": train_s, "tokens_per_s": tokens / train_s, "wall_s": measured["seconds"],
            "peak_rss_mb": measured["peak_rss_mb"], "tokens": tokens, "loss": steps[-1]["loss"]}


def run_trl(kit: Path, fixture: Path, packing: bool) -> dict:
    command = [sys.executable, str(kit / "measure.py"), sys.executable, str(kit / "peer_trl.py"), str(fixture),
               "--epochs", "1", "--batch", str(SETTINGS["batch"]), "--seq", str(SETTINGS["seq"]),
               "--rank", str(SETTINGS["rank"]), "--gc"] + (["--packing"] if packing else [])
    measured = run_json(command)
    peer = json.loads([line for line in measured["tail"].splitlines() if line.startswith("{")][-1])
    return {"train_s": peer["seconds"], "tokens_per_s": peer["tokens_per_s"], "wall_s": measured["seconds"],
            "peak_rss_mb": measured["peak_rss_mb"], "tokens": peer["tokens"], "loss": peer["loss"]}


def render(vocab: int, rounds: int, results: dict[str, list[dict]], command: str) -> str:
    med = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    peer_names = [n for n in med if n.startswith("TRL")]
    lines = [f"### Fixture vocab {vocab}: gpupoor vs TRL SFTTrainer + peft (CPU, fp32)", "",
             f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}; one epoch "
             f"over the kit's 400 rows, micro batch {SETTINGS['batch']}, max_length {SETTINGS['seq']}, LoRA "
             f"r{SETTINGS['rank']} on all linear layers, gradient checkpointing on both sides. Medians of {rounds} "
             "alternating rounds. Real tokens/s = non-padding tokens / each side's own training time (TRL's "
             "`train_runtime`, gpupoor's `elapsed_s`); wall = the whole process; peak RSS of the process.", "",
             "| run | real tokens/s | train s | wall s | peak RSS MB | final loss |", "|---|---|---|---|---|---|"]
    for name, m in med.items():
        lines.append(f"| {name} | {m['tokens_per_s']:.0f} | {m['train_s']:.1f} | {m['wall_s']:.1f} | "
                     f"{m['peak_rss_mb']:.0f} | {m['loss']:.3f} |")
    lines.append("")
    if peer_names:
        fastest_peer = max(peer_names, key=lambda n: med[n]["tokens_per_s"])
        lowest_peer = min(peer_names, key=lambda n: med[n]["peak_rss_mb"])
    for name in (n for n in med if peer_names and not n.startswith("TRL")):
        m = med[name]
        lines.append(f"- {name}: {m['tokens_per_s'] / med[fastest_peer]['tokens_per_s']:.2f}x the real tokens/s of "
                     f"the faster peer ({fastest_peer}), {med[fastest_peer]['wall_s'] / m['wall_s']:.2f}x faster on "
                     f"whole-process wall time, {m['peak_rss_mb'] / med[lowest_peer]['peak_rss_mb']:.2f}x the peak "
                     f"RSS of the leaner peer ({lowest_peer}).")
    lines.append("")
    lines.append("Every round: " + "; ".join(
        f"{name} " + ", ".join(f"{r['tokens_per_s']:.0f} tok/s {r['peak_rss_mb']:.0f} MB" for r in runs)
        for name, runs in results.items()))
    return "\n".join(lines) + "\n"


def write_section(doc: Path, key: str, body: str) -> None:
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    block = f"{start}\n{body}{end}"
    if start in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--sides", default="gpupoor-packed,gpupoor-length_grouped,gpupoor-random,trl-padded,trl-packed",
                        help="comma-separated: gpupoor-SAMPLER (packed, length_grouped, random), trl-padded, trl-packed")
    parser.add_argument("--key", default=None, help="section of docs/benchmarks.md to write (default: by vocab)")
    parser.add_argument("--extra", default="", help="extra `--set` overrides for gpupoor, comma-separated")
    args = parser.parse_args()
    kit = Path(args.kit)
    if not (kit / "peer_trl.py").is_file():
        raise SystemExit(f"the peer benchmark kit is not at {kit}: `make bench` compares gpupoor against it "
                         "(a clone of gpupoor alone has no kit). Pass --kit PATH if it lives elsewhere.")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("the peer needs trl: pip install trl (make bench does this)") from None
    fixture = build_fixture(kit, args.vocab)
    extra = [item for item in args.extra.split(",") if item]
    sides = {}
    for side in args.sides.split(","):
        tool, _, variant = side.partition("-")
        if tool == "gpupoor":
            label = f"gpupoor ({variant}{', ' + ', '.join(extra) if extra else ''})"
            sides[label] = (lambda v=variant: run_gpupoor(kit, fixture, v, extra))
        else:
            sides[f"TRL {variant}"] = (lambda v=variant: run_trl(kit, fixture, packing=v == "packed"))
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        for name, run in sides.items():  # alternate the sides within every round
            results[name].append(run())
            r = results[name][-1]
            print(f"round {round_index + 1} {name}: {r['tokens_per_s']:.0f} tok/s, train {r['train_s']:.1f} s, "
                  f"wall {r['wall_s']:.1f} s, {r['peak_rss_mb']:.0f} MB", flush=True)
    command = "make bench" if sys.argv[1:] in ([], ["--kit", args.kit]) else \
        "python bench/compare_trl.py " + " ".join(a for a in sys.argv[1:] if not a.startswith("--kit") and a != args.kit)
    body = render(args.vocab, args.rounds, results, command)
    write_section(ROOT / "docs" / "benchmarks.md", args.key or f"trl-v{args.vocab}", body)
    print(body)


if __name__ == "__main__":
    main()
