"""gpupoor vs the peer (TRL SFTTrainer + peft) on the peer kit's offline fixture, side by side.

The issue's reference fixture: the kit's fixture.py with 160 alpaca rows (about 16.9k tokens), a random-weight
Llama h256 x 4 layers at vocab 32000 (or 152064), micro batch 8, max_length 512, LoRA r16 on all linear
layers, fp32, the same prompt/completion text on every side, one epoch.

Each side is a fresh process under the kit's measure.py (whole-process wall seconds, peak RSS). The sides run
in alternating rounds (the order rotates every round) and every run is bracketed by the machine's matmul probe
(bench/machine.py): a run the machine was busy for is rejected and repeated. The table gives medians with their
min-max over the rounds, lists the rejected and noisy runs, and the gpupoor/peer ratios are of the medians.

Sides (--sides, comma-separated): gpupoor-SAMPLER[-gc] with SAMPLER packed, length_grouped or random,
trl-packed[-gc], trl-padded[-gc], and lf-packed[-gc], lf-neat[-gc] (LLaMA-Factory in its own venv, its default
and its block-diagonal packing: bench/peer_llamafactory.py);
"-gc" turns gradient checkpointing on for that side, and only for it.

    python bench/compare_trl.py [--rounds 3] [--vocab 32000] [--rows 160] [--sides ...] [--kit ../shared/bench]

`make bench` runs it at vocab 32000 and at 152064, 3 rounds each: about 12-15 minutes on a quiet 2-core machine
(~4 at 32000, 8-10 at 152064; TRL's epoch is most of it). Needs the peer kit (../shared/bench by default)
and `trl` in the venv (`make bench` installs it).
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_llamafactory  # noqa: E402
from machine import ROOT, Steady, run_table_rows, shown_command, spread, usable_cores, write_section  # noqa: E402, F401

SETTINGS = {"batch": 8, "seq": 512, "rank": 16}  # the comparison the issue asks for
REFERENCE_ROWS = 160  # the reference fixture
KIT_ROWS = 400  # fixture.py's own default: what bench/distributed.py trained on, kept for it
DEFAULT_SIDES = "gpupoor-packed,gpupoor-packed-gc,trl-packed"
SIDES_HELP = ("comma-separated: gpupoor-{packed,length_grouped,random}[-gc][-bf16|-auto], trl-{packed,padded}[-gc], "
              "lf-{packed,neat}[-gc][-bf16]")
LF_PYTHON_HELP = (f"the python of LLaMA-Factory's venv, for lf-* sides (default: ${peer_llamafactory.PYTHON_ENV} or "
                  "../lf-venv/bin/python; `make bench-lf-venv` builds it)")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # both sides: no network call inflates a wall time


def run_json(command: list[str], env: dict | None = None) -> dict:
    """Run a command that prints a JSON line; return the last one."""
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"failed: {' '.join(command)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def measured_run(kit: Path, command: list[str], env: dict | None = None) -> dict:
    """The kit's measure.py around `command`; it exits 0 whatever the command did, so check the command's code."""
    measured = run_json([sys.executable, str(kit / "measure.py"), *command], env={**OFFLINE, **(env or {})})
    if measured["code"] != 0:
        raise SystemExit(f"failed (exit {measured['code']}): {' '.join(command)}\n{measured['tail']}")
    return measured


def fixture_dir(vocab: int, rows: int, hidden: int = 256, layers: int = 4) -> Path:
    size = "" if (hidden, layers) == (256, 4) else f"h{hidden}-l{layers}-"
    return ROOT / "build" / "bench" / f"fixture-{size}r{rows}-v{vocab}"


def build_fixture(kit: Path, vocab: int, rows: int = KIT_ROWS, hidden: int = 256, layers: int = 4) -> Path:
    """The kit's fixture (cached under build/bench/), plus the prompt/completion file gpupoor trains on."""
    fixture = fixture_dir(vocab, rows, hidden, layers)
    if not (fixture / "fixture.json").is_file():  # written last: a build that was cut off is built again
        print(f"building the kit's fixture in {fixture} ...", flush=True)
        stats = run_json([sys.executable, str(kit / "fixture.py"), str(fixture), "--vocab", str(vocab),
                          "--rows", str(rows), "--hidden", str(hidden), "--layers", str(layers)])
        (fixture / "fixture.json").write_text(json.dumps(stats) + "\n")  # rows and tokens, for the captions
    # The peer trains on prompt = instruction + "\n" + input + "\n", completion = output: give gpupoor the
    # very same text (its `completion` format), so both sides see the same tokens.
    rows_read = [json.loads(line) for line in (fixture / "data.jsonl").read_text().splitlines()]
    (fixture / "prompt-completion.jsonl").write_text("".join(
        json.dumps({"prompt": r["instruction"] + "\n" + r["input"] + "\n", "completion": r["output"]}) + "\n"
        for r in rows_read))
    return fixture


def fixture_stats(fixture: Path) -> dict:
    path = fixture / "fixture.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def gpupoor_recipe(fixture: Path, sampler: str, checkpointing: bool = True) -> Path:
    """The fixture's recipe for one epoch; the other benchmarks vary it with --set."""
    recipe = fixture / f"gpupoor-{sampler}{'' if checkpointing else '-nogc'}.yaml"
    recipe.write_text(
        f"model: {{name_or_path: model}}\n"
        f"data: {{path: prompt-completion.jsonl, format: completion, max_length: {SETTINGS['seq']}, "
        f"sampler: {sampler}}}\n"
        f"peft: {{rank: {SETTINGS['rank']}, alpha: {2 * SETTINGS['rank']}}}\n"
        "precision: fp32\n"
        f"training: {{micro_batch_size: {SETTINGS['batch']}, epochs: 1, learning_rate: 2.0e-4}}\n"
        f"memory: {{gradient_checkpointing: {str(checkpointing).lower()}}}\n"
        "checkpoint: {every_minutes: 1000}\n"
        "logging: {progress: none}\n")
    return recipe


def read_metrics(run_dir: Path) -> tuple[dict | None, list[dict]]:
    """(the "start" record or None, the step records) of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next((r for r in records if r.get("event") == "start"), None)
    return start, [r for r in records if "loss" in r and "tokens" in r]


def startup_breakdown(start: dict | None) -> dict | None:
    """Seconds per start-up phase, when the run's start record carries them (`startup_s`, or `startup`)."""
    start = start or {}
    found = start.get("startup_s", start.get("startup"))
    return found if isinstance(found, dict) else None


def run_gpupoor(kit: Path, fixture: Path, sampler: str, checkpointing: bool, extra: list[str],
                run_dir: Path | None = None, precision: str = "fp32") -> dict:
    """`precision`: the recipe's (fp32, bf16 or auto: on a CPU with bf16 matrix units, bf16)."""
    suffix = "" if precision == "fp32" else f"-{precision}"
    run_dir = run_dir or fixture / f"run-gpupoor-{sampler}{'-gc' if checkpointing else ''}{suffix}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [arg for item in [*extra, f"precision={precision}"] for arg in ("--set", item)]
    measured = measured_run(kit, [str(ROOT / ".venv" / "bin" / "gpupoor"), "train",
                                  str(gpupoor_recipe(fixture, sampler, checkpointing)), "--output-dir", str(run_dir),
                                  *overrides])
    start, steps = read_metrics(run_dir)
    tokens = sum(step["tokens"] for step in steps)
    train_s = steps[-1]["elapsed_s"]
    # The epoch's mean step loss: what TRL reports as training_loss, so the two columns compare.
    return {"train_s": train_s, "tokens_per_s": tokens / train_s, "wall_s": measured["seconds"],
            "peak_rss_mb": measured["peak_rss_mb"], "tokens": tokens,
            "loss": statistics.fmean(step["loss"] for step in steps),
            "startup": startup_breakdown(start), "run_dir": str(run_dir)}


def run_trl(kit: Path, fixture: Path, packing: bool, checkpointing: bool) -> dict:
    command = [sys.executable, str(kit / "peer_trl.py"), str(fixture),
               "--epochs", "1", "--batch", str(SETTINGS["batch"]), "--seq", str(SETTINGS["seq"]),
               "--rank", str(SETTINGS["rank"])] + (["--gc"] if checkpointing else []) + \
              (["--packing"] if packing else [])
    measured = measured_run(kit, command)
    peer = json.loads([line for line in measured["tail"].splitlines() if line.startswith("{")][-1])
    return {"train_s": peer["seconds"], "tokens_per_s": peer["tokens_per_s"], "wall_s": measured["seconds"],
            "peak_rss_mb": measured["peak_rss_mb"], "tokens": peer["tokens"], "loss": peer["loss"]}


def run_llamafactory(kit: Path, fixture: Path, neat: bool, checkpointing: bool, bf16: bool = False) -> dict:
    command, run_dir, tokens = peer_llamafactory.prepare(fixture, SETTINGS, neat, checkpointing, bf16)
    measured = measured_run(kit, command, env=peer_llamafactory.environment())
    return {**peer_llamafactory.results(run_dir, tokens), "wall_s": measured["seconds"],
            "peak_rss_mb": measured["peak_rss_mb"]}


@dataclass(frozen=True)
class Side:
    """One column of the comparison, as named on the command line: tool-layout[-gc][-PRECISION]."""

    tool: str  # gpupoor | trl | lf (LLaMA-Factory)
    layout: str  # gpupoor: its data.sampler; trl: packed | padded; lf: packed | neat (block-diagonal packing)
    checkpointing: bool
    # fp32 (every side's default); gpupoor also bf16 or auto (bf16 on a CPU with bf16 matrix units), LLaMA-Factory
    # bf16 (its `bf16: true`: the weights loaded in bf16, LoRA in fp32, autocast)
    precision: str = "fp32"

    @classmethod
    def parse(cls, name: str) -> Side:
        tool, _, rest = name.partition("-")
        precision = next((p for p in ("bf16", "auto") if rest.endswith(f"-{p}")), "fp32")
        rest = rest.removesuffix(f"-{precision}")
        checkpointing = rest.endswith("-gc")
        layout = rest.removesuffix("-gc")
        precisions = {"gpupoor": ("fp32", "bf16", "auto"), "lf": ("fp32", "bf16"), "trl": ("fp32",)}
        if precision not in precisions.get(tool, ()):
            raise SystemExit(f"unknown side {name!r}: -bf16 and -auto are gpupoor's, -bf16 LLaMA-Factory's too")
        allowed = {"gpupoor": ("packed", "length_grouped", "random"), "trl": ("packed", "padded"),
                   "lf": ("packed", "neat")}
        if layout not in allowed.get(tool, ()):
            raise SystemExit(f"unknown side {name!r}: use gpupoor-{{packed,length_grouped,random}}[-gc], "
                             "trl-{packed,padded}[-gc] or lf-{packed,neat}[-gc]")
        return cls(tool, layout, checkpointing, precision)

    def label(self, extra: list[str], versions: dict[str, str]) -> str:
        """`versions`: check_prerequisites' peer versions."""
        what = {"random": "random order", "neat": "neat-packed (block-diagonal)"}.get(
            self.layout, self.layout.replace("_", "-"))
        name = {"gpupoor": f"gpupoor {what}", "trl": f"TRL {versions.get('trl')} SFTTrainer + peft {what}",
                "lf": f"LLaMA-Factory {versions.get('lf')} + peft {what}"}[self.tool]
        if self.tool == "gpupoor" and extra:
            name += f" ({', '.join(extra)})"
        precision = "" if self.precision == "fp32" else f", precision {self.precision}"
        return name + (" + gradient checkpointing" if self.checkpointing else "") + precision

    def run(self, kit: Path, fixture: Path, extra: list[str]) -> dict:
        if self.tool == "gpupoor":
            return run_gpupoor(kit, fixture, self.layout, self.checkpointing, extra, precision=self.precision)
        if self.tool == "lf":
            return run_llamafactory(kit, fixture, self.layout == "neat", self.checkpointing, self.precision == "bf16")
        return run_trl(kit, fixture, packing=self.layout == "packed", checkpointing=self.checkpointing)


def run_rounds(sides: dict[str, Side], rounds: int, kit: Path, fixture: Path, extra: list[str],
               steady: Steady) -> dict[str, list[dict]]:
    """Every side once a round, the order rotated each round (no side always runs first on a cold machine)."""
    results: dict[str, list[dict]] = {label: [] for label in sides}
    labels = list(sides)
    for round_index in range(rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            result = steady.run(f"{label}, round {round_index + 1}",
                                lambda side=sides[label]: side.run(kit, fixture, extra))
            results[label].append(result)
            print(f"round {round_index + 1} {label}: train {result['train_s']:.1f} s, wall {result['wall_s']:.1f} s,"
                  f" {result['peak_rss_mb']:.0f} MB, {result['tokens_per_s']:.0f} tok/s, GFLOP/s "
                  f"{result['gflops_before']:.0f}/{result['gflops_after']:.0f}"
                  f"{' (noisy)' if result['noisy'] else ''}", flush=True)
    return results


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def result_table(results: dict[str, list[dict]]) -> list[str]:
    lines = ["| run | training s | whole process s | peak RSS MB | real tokens/s | loss (epoch mean) | "
             "GFLOP/s before | GFLOP/s after |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    return lines + run_table_rows(results)


def ratio_table(results: dict[str, list[dict]], sides: dict[str, Side]) -> list[str]:
    """Every gpupoor side against every peer side (TRL, LLaMA-Factory), from the medians."""
    ours = [label for label in results if sides[label].tool == "gpupoor"]
    peers = [label for label in results if sides[label].tool != "gpupoor"]
    if not ours or not peers:
        return []
    lines = ["| gpupoor side | against | training time: peer / gpupoor | whole process: peer / gpupoor | "
             "peak RSS: gpupoor / peer | same checkpointing |", "|---|---|---:|---:|---:|---|"]
    for mine in ours:
        for peer in peers:
            a, b = results[mine], results[peer]
            same = "yes" if sides[mine].checkpointing == sides[peer].checkpointing else "no"
            lines.append(f"| {mine} | {peer} | {med(b, 'train_s') / med(a, 'train_s'):.2f}x | "
                         f"{med(b, 'wall_s') / med(a, 'wall_s'):.2f}x | "
                         f"{med(a, 'peak_rss_mb') / med(b, 'peak_rss_mb'):.2f}x | {same} |")
    return lines


def render(vocab: int, rounds: int, results: dict[str, list[dict]], sides: dict[str, Side], stats: dict,
           steady: Steady, command: str, versions: dict[str, str]) -> str:
    rows = stats.get("rows", "?")
    tokens = f", {stats['tokens']:,} tokens as fixture.py counts them (without the EOS each side appends)" \
        if "tokens" in stats else ""
    lines = [f"### Reference fixture at vocab {vocab}: gpupoor vs {peer_names(sides, versions)} (CPU, fp32)",
             "",
             f"`{command}` on {usable_cores()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}. The kit's "
             f"fixture: {rows} alpaca rows{tokens}, a random-weight Llama h256 x 4 layers, vocab {vocab}; one epoch, "
             f"micro batch {SETTINGS['batch']}, max_length {SETTINGS['seq']}, LoRA r{SETTINGS['rank']} on all "
             "linear layers, fp32, the same prompt/completion text on every side; gradient checkpointing only where "
             f"the row says so. Median (min-max) of {rounds} alternating rounds. Training s = each side's own "
             "training time (TRL's and LLaMA-Factory's `train_runtime`, gpupoor's `elapsed_s`); whole process = the "
             "process's wall time under the kit's measure.py, start-up included; peak RSS of the process; real "
             "tokens/s = non-padding tokens / training s; loss = the mean step loss over the epoch (what TRL "
             "reports as `training_loss`). " + steady.summary(), ""]
    return "\n".join(lines + result_sections(results, sides, steady)) + "\n"


def result_sections(results: dict[str, list[dict]], sides: dict[str, Side], steady: Steady) -> list[str]:
    """What follows a section's heading and description, here and in compare_trl_real.py: the results table, the
    runs the probe flagged, the ratio table and the tokens each side counted."""
    lines = result_table(results)
    notes = steady.notes()
    if notes:
        lines += ["", "Runs the probe flagged:", *notes]
    ratios = ratio_table(results, sides)
    if ratios:
        lines += ["", "Ratios of the medians:", "", *ratios]
    counted = "; ".join(f"{label} {med(runs, 'tokens'):,.0f}" for label, runs in results.items())
    return lines + ["", f"Tokens each side counted for the epoch: {counted}."]


def peer_names(sides: dict[str, Side], versions: dict[str, str]) -> str:
    """The peers a section compares against, for its heading: "TRL 1.16.0 SFTTrainer + peft and LLaMA-Factory ..."."""
    names = {"trl": f"TRL {versions.get('trl')} SFTTrainer + peft", "lf": f"LLaMA-Factory {versions.get('lf')} + peft"}
    return " and ".join(names[tool] for tool in names if any(side.tool == tool for side in sides.values())) or \
        "no peer"


def check_prerequisites(kit: Path, sides: list[Side], lf_python: str | None = None) -> dict[str, str]:
    """The kit must be there; trl only when a TRL side runs, LLaMA-Factory (in `lf_python`'s venv) only when an LF
    side runs. Returns the peers' versions: {"trl": ..., "lf": ...} for those that run."""
    if not (kit / "peer_trl.py").is_file():
        raise SystemExit(f"the peer benchmark kit is not at {kit}: `make bench` compares gpupoor against it "
                         "(a clone of gpupoor alone has no kit). Pass --kit PATH if it lives elsewhere.")
    versions = {}
    if any(side.tool == "lf" for side in sides):
        versions["lf"] = peer_llamafactory.check_install(lf_python or peer_llamafactory.default_python())
    if any(side.tool == "trl" for side in sides):
        try:
            import trl
        except ImportError:
            raise SystemExit("the peer needs trl: pip install trl (make bench does this)") from None
        versions["trl"] = trl.__version__
    return versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=REFERENCE_ROWS, help="the fixture's alpaca rows")
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--sides", default=DEFAULT_SIDES, help=SIDES_HELP)
    parser.add_argument("--lf-python", default=peer_llamafactory.default_python(), help=LF_PYTHON_HELP)
    parser.add_argument("--key", default=None, help="section of the doc to write (default: trl-vVOCAB)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to write into")
    parser.add_argument("--extra", default="", help="extra `--set` overrides for gpupoor, comma-separated")
    args = parser.parse_args()
    kit = Path(args.kit)
    parsed = [Side.parse(name) for name in args.sides.split(",") if name]
    versions = check_prerequisites(kit, parsed, args.lf_python)
    os.environ[peer_llamafactory.PYTHON_ENV] = args.lf_python  # where the LF side's runs find it
    extra = [item for item in args.extra.split(",") if item]
    sides = {side.label(extra, versions): side for side in parsed}
    fixture = build_fixture(kit, args.vocab, args.rows)
    steady = Steady()
    print(f"matmul reference before the first run: {steady.warm_up():.0f} GFLOP/s", flush=True)
    results = run_rounds(sides, args.rounds, kit, fixture, extra, steady)
    command = shown_command("bench/compare_trl.py", sys.argv[1:])
    body = render(args.vocab, args.rounds, results, sides, fixture_stats(fixture), steady, command, versions)
    write_section(Path(args.doc), args.key or f"trl-v{args.vocab}", body)
    print(body)


if __name__ == "__main__":
    main()
