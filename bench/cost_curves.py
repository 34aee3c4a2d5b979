"""How gpupoor's cost grows: tokens/s and peak RSS against sequence length, model width, depth and LoRA rank.

Every point is a fresh `gpupoor train` process under the peer kit's measure.py (peak RSS of the process) on a
model built by the kit's fixture.py (random-weight Llama, vocab 32000; hidden and layers as the axis says) and
the same alpaca rows for every point (--rows, default 3000: enough that even 4096-token packed rows fill every
micro-batch of every step). Fixed for every point: packed micro-batches of 8 rows, LoRA r16 (alpha 2r) on all
linear layers, fp32, gradient checkpointing ON (--no-gc turns it off), `training.max_steps` = --steps.

    axis    points                               the rest
    seq     max_length 512, 1024, 2048, 4096     h256 x 4 layers, r16  (max_length = the packed row length)
    width   hidden 256, 512, 1024                4 layers, seq 512, r16
    depth   layers 4, 8, 16                      h256, seq 512, r16
    rank    LoRA rank 8, 16, 32, 64, 128, 256    h256 x 4 layers, seq 512

tokens/s = real (non-padding) tokens / step time, summed over every step but the first (which also builds the
optimizer's state and warms the allocator), from the run's metrics.jsonl. The base point (h256 x 4, seq 512, r16)
belongs to every axis and runs once per round. Each round runs every distinct point once, in a shuffled order
(a different one each round), each between two matmul probes (bench/machine.py: a run the machine was busy for
is rejected and repeated). The results accumulate in build/bench/curves/results.json (a later `--axes seq`
replaces the seq axis only); the section `curves` of docs/benchmarks.md is rendered from all of them, with one
PNG per axis in docs/img/. The per-point ratios that say where a curve bends are printed to stdout.

    python bench/cost_curves.py [--axes seq,width,depth,rank] [--rounds 2] [--steps 5] [--rows 3000] [--no-gc]
                                [--limit N] [--kit ../shared/bench]

Expected duration on a quiet 2-core machine with the defaults: about 20 minutes (13 distinct points x 2 rounds;
the seq 4096 point alone is about a third of it), plus about 2 minutes the first time to build the 5 models.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import OFFLINE, ROOT, SETTINGS, build_fixture, gpupoor_recipe, read_metrics, run_json  # noqa: E402
from machine import Steady, shown_command, spread, usable_cores, write_section  # noqa: E402

VOCAB = 32000
WORK = ROOT / "build" / "bench" / "curves"
CACHE = ROOT / "build" / "bench" / "gpupoor-cache"  # tokenized data reused between runs, away from ~/.cache


@dataclass(frozen=True)
class Point:
    hidden: int = 256
    layers: int = 4
    seq: int = SETTINGS["seq"]
    rank: int = SETTINGS["rank"]

    @property
    def key(self) -> str:
        return f"h{self.hidden}-l{self.layers}-s{self.seq}-r{self.rank}"


BASE = Point()


@dataclass(frozen=True)
class Axis:
    name: str
    title: str  # what varies, for the headings
    field: str  # the Point field
    values: tuple[int, ...]
    log2: bool  # doubling points: a log2 x axis

    def points(self, limit: int | None = None) -> list[Point]:
        return [replace(BASE, **{self.field: value}) for value in self.values[:limit]]


AXES = {
    "seq": Axis("seq", "sequence length (packed row length, data.max_length)", "seq", (512, 1024, 2048, 4096), True),
    "width": Axis("width", "model width (hidden size; 4 layers)", "hidden", (256, 512, 1024), True),
    "depth": Axis("depth", "model depth (decoder layers; hidden 256)", "layers", (4, 8, 16), True),
    "rank": Axis("rank", "LoRA rank (all linear layers)", "rank", (8, 16, 32, 64, 128, 256), True),
}


def build_fixtures(kit: Path, points: list[Point], rows: int) -> None:
    """Every model the points need, before the first probe (a build is not part of any measured run)."""
    for shape in sorted({(p.hidden, p.layers) for p in points}):
        build_fixture(kit, VOCAB, rows, *shape)


def run_point(kit: Path, point: Point, steps: int, rows: int, checkpointing: bool) -> dict:
    """One `gpupoor train` of `steps` steps at this point; tokens/s from every step but the first."""
    fixture = build_fixture(kit, VOCAB, rows, point.hidden, point.layers)  # cached: only rewrites the rows file
    run_dir = WORK / f"run-{point.key}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"training.max_steps={steps}", f"data.max_length={point.seq}", f"peft.rank={point.rank}",
            f"peft.alpha={2 * point.rank}"]
    command = [sys.executable, str(kit / "measure.py"), str(ROOT / ".venv" / "bin" / "gpupoor"), "train",
               str(gpupoor_recipe(fixture, "packed", checkpointing)), "--output-dir", str(run_dir),
               *[arg for item in sets for arg in ("--set", item)]]
    measured = run_json(command, env={**OFFLINE, "GPUPOOR_CACHE": str(CACHE)})
    if measured["code"] != 0:
        raise SystemExit(f"{point.key} failed (exit {measured['code']}):\n{measured['tail']}")
    _, records = read_metrics(run_dir)
    timed = records[1:]
    if len(records) < steps or not timed:
        raise SystemExit(f"{point.key}: {len(records)} of {steps} steps ran (too few rows for this row length? "
                         "raise --rows)")
    tokens, seconds = sum(r["tokens"] for r in timed), sum(r["step_s"] for r in timed)
    return {"tokens_per_s": tokens / seconds, "step_s": statistics.median(r["step_s"] for r in timed),
            "tokens_per_step": tokens / len(timed), "peak_rss_mb": measured["peak_rss_mb"],
            "wall_s": measured["seconds"], "first_step_s": records[0]["step_s"]}


def measure(kit: Path, points: list[Point], rounds: int, steps: int, rows: int, checkpointing: bool,
            steady: Steady) -> dict[str, list[dict]]:
    """Every distinct point once a round, in a shuffled order that differs from round to round."""
    results: dict[str, list[dict]] = {point.key: [] for point in points}
    started = time.monotonic()
    for round_index in range(rounds):
        order = list(points)
        random.Random(round_index).shuffle(order)
        print(f"round {round_index + 1}: " + ", ".join(p.key for p in order), flush=True)
        for point in order:
            result = steady.run(f"{point.key}, round {round_index + 1}",
                                lambda point=point: run_point(kit, point, steps, rows, checkpointing))
            results[point.key].append(result)
            print(f"  {point.key}: {result['tokens_per_s']:.0f} tok/s, step {result['step_s']:.2f} s, "
                  f"{result['tokens_per_step']:.0f} tokens/step, {result['peak_rss_mb']:.0f} MB, GFLOP/s "
                  f"{result['gflops_before']:.0f}/{result['gflops_after']:.0f}{' (noisy)' if result['noisy'] else ''}"
                  f"  [{(time.monotonic() - started) / 60:.1f} min so far]", flush=True)
    return results


def model_sizes(point: Point) -> dict[str, float]:
    """Millions of parameters, from the fixture's shapes (fixture.py: intermediate = 11/4 hidden, heads of
    64, kv heads of 128): the decoder layers' weights, the output head, and the LoRA adapters."""
    h, layers, r = point.hidden, point.layers, point.rank
    intermediate, kv = h * 11 // 4, max(1, h // 128) * (h // max(1, h // 64))
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, intermediate), (h, intermediate), (intermediate, h)]
    return {"layers_m": layers * sum(a * b for a, b in linears) / 1e6, "head_m": h * VOCAB / 1e6,
            "lora_m": layers * sum(r * (a + b) for a, b in linears) / 1e6}


def axis_record(axis: Axis, results: dict[str, list[dict]], limit: int | None, meta: dict,
                steady: Steady) -> dict:
    """What the doc and the plot need of one axis; the probe's notes on this axis's points only."""
    points = axis.points(limit)
    notes = [line for line in steady.notes() if any(f"{p.key}, round" in line for p in points)]
    return {**meta, "notes": notes, "points": [{"value": getattr(p, axis.field), "point": asdict(p),
                                                "runs": results[p.key]} for p in points]}


def load_store() -> dict:
    path = WORK / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def save_store(store: dict) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "results.json").write_text(json.dumps(store, indent=1))


def medians(record: dict, key: str) -> list[float]:
    return [statistics.median(run[key] for run in p["runs"]) for p in record["points"]]


def plot(axis: Axis, record: dict, target: Path) -> None:
    """tokens/s and peak RSS against the axis, median with min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["value"] for p in record["points"]]
    figure, panels = plt.subplots(1, 2, figsize=(9, 3.4))
    for panel, key, label in zip(panels, ("tokens_per_s", "peak_rss_mb"), ("real tokens/s", "peak RSS (MB)")):
        values = [[run[key] for run in p["runs"]] for p in record["points"]]
        middle = [statistics.median(v) for v in values]
        bars = [[m - min(v) for m, v in zip(middle, values)], [max(v) - m for m, v in zip(middle, values)]]
        panel.errorbar(xs, middle, yerr=bars, marker="o", capsize=3)
        if axis.log2:
            panel.set_xscale("log", base=2)
        panel.set_xticks(xs, [str(x) for x in xs])
        panel.set_xlabel(axis.title)
        panel.set_ylabel(label)
        panel.set_ylim(bottom=0)
        panel.grid(alpha=0.3)
    figure.suptitle(f"gpupoor, {axis.name}: {record['setting_short']}", fontsize=9)
    figure.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    plt.close(figure)


def axis_table(axis: Axis, record: dict) -> list[str]:
    tokens, rss = medians(record, "tokens_per_s"), medians(record, "peak_rss_mb")
    lines = [f"| {axis.field} | real tokens/s | vs first | median step s | real tokens/step | peak RSS MB | "
             "+MB vs smallest | GFLOP/s before | GFLOP/s after |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, t, m in zip(record["points"], tokens, rss):
        runs = p["runs"]

        def col(key: str, fmt: str) -> str:
            return spread([run[key] for run in runs], fmt)

        lines.append(f"| {p['value']} | {col('tokens_per_s', '{:.0f}')} | {t / tokens[0]:.2f}x | "
                     f"{col('step_s', '{:.2f}')} | {statistics.median(r['tokens_per_step'] for r in runs):.0f} | "
                     f"{col('peak_rss_mb', '{:.0f}')} | +{m - min(rss):.0f} | {col('gflops_before', '{:.0f}')} | "
                     f"{col('gflops_after', '{:.0f}')} |")
    return lines


def render(store: dict, doc: Path) -> str:
    lines = ["## How the cost grows", "",
             "Each axis moves one setting away from the base point (the kit's fixture model h256 x 4 layers, vocab "
             "32000; packed micro-batches of 8 rows of 512 tokens; LoRA r16 on all linear layers; fp32). Real "
             "tokens/s exclude the first step; peak RSS is the whole process's (kit's measure.py). Median "
             "(min-max) over the rounds."]
    for name, axis in AXES.items():
        record = store.get(name)
        if record is None:
            continue
        image = doc.parent / "img" / f"curve-{name}.png"
        plot(axis, record, image)
        lines += ["", f"### Against {axis.title}", "",
                  f"`{record['command']}` on {record['cores']} cores ({record['machine']}), {record['date']}: "
                  f"{record['setting']} {record['probes']}", "", *axis_table(axis, record)]
        if record["notes"]:
            lines += ["", "Runs the probe flagged:", *record["notes"]]
        lines += ["", f"![tokens/s and peak RSS against {axis.title}]({image.relative_to(doc.parent).as_posix()})"]
    lines += ["", "### Where it bends", "",
              "**PLACEHOLDER (to be written from the real run; move it outside this bench:curves block, or a rerun "
              "overwrites it):** where each curve bends and why: attention's quadratic term (seq), the output "
              "head's share of the step (width, depth), the allocator (peak RSS steps), the LoRA rank (rank)."]
    return "\n".join(lines) + "\n"


def print_ratios(store: dict) -> None:
    """What helps to say where each curve bends: throughput relative to the first point, time per token,
    RSS above the smallest point, and the parameter counts that set the matmul work."""
    for name, axis in AXES.items():
        record = store.get(name)
        if record is None:
            continue
        tokens, rss = medians(record, "tokens_per_s"), medians(record, "peak_rss_mb")
        print(f"\n{name}: {axis.title}")
        print(f"  {axis.field:>6} {'tok/s':>7} {'vs 1st':>7} {'s/token vs 1st':>15} {'RSS-min MB':>11} "
              f"{'layers M':>9} {'head M':>7} {'LoRA M':>7} {'layers/head':>12}")
        for p, t, m in zip(record["points"], tokens, rss):
            size = model_sizes(Point(**p["point"]))
            print(f"  {p['value']:>6} {t:7.0f} {t / tokens[0]:6.2f}x {tokens[0] / t:14.2f}x {m - min(rss):11.0f} "
                  f"{size['layers_m']:9.2f} {size['head_m']:7.2f} {size['lora_m']:7.3f} "
                  f"{size['layers_m'] / size['head_m']:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--axes", default=",".join(AXES), help="comma-separated subset of " + ", ".join(AXES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--rows", type=int, default=3000, help="the fixture's alpaca rows (the same for every point)")
    parser.add_argument("--no-gc", action="store_true", help="gradient checkpointing off (default: on)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N points of each axis (a check)")
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"),
                        help="markdown file to write into; the PNGs go to img/ beside it")
    args = parser.parse_args()
    kit = Path(args.kit)
    if not (kit / "fixture.py").is_file():
        raise SystemExit(f"the peer benchmark kit is not at {kit}: the curves use its fixture.py and measure.py. "
                         "Pass --kit PATH if it lives elsewhere.")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first step is not timed")
    names = [name for name in args.axes.split(",") if name]
    unknown = [name for name in names if name not in AXES]
    if unknown:
        raise SystemExit(f"unknown axes {unknown}: choose from {', '.join(AXES)}")
    checkpointing = not args.no_gc
    points = list({p.key: p for name in names for p in AXES[name].points(args.limit)}.values())  # base once
    build_fixtures(kit, points, args.rows)
    steady = Steady()
    print(f"{len(points)} distinct points x {args.rounds} rounds; matmul reference {steady.warm_up():.0f} GFLOP/s",
          flush=True)
    results = measure(kit, points, args.rounds, args.steps, args.rows, checkpointing, steady)
    setting = (f"{args.steps} steps per run (the first not timed), {args.rows} alpaca rows, packed micro-batches "
               f"of {SETTINGS['batch']}, LoRA alpha 2r, fp32, gradient checkpointing "
               f"{'on' if checkpointing else 'off'}; median (min-max) of {args.rounds} rounds in shuffled order.")
    meta = {"command": shown_command("bench/cost_curves.py", sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "cores": usable_cores(), "machine": platform.machine(), "setting": setting, "probes": steady.summary(),
            "setting_short": f"gc {'on' if checkpointing else 'off'}, micro batch {SETTINGS['batch']}, packed, fp32"}
    store = load_store()
    for name in names:
        store[name] = axis_record(AXES[name], results, args.limit, meta, steady)
    save_store(store)
    doc = Path(args.doc)
    write_section(doc, "curves", render(store, doc))
    print_ratios(store)
    print(f"\nwrote the section `curves` of {doc} and its PNGs in {doc.parent / 'img'}")


if __name__ == "__main__":
    main()
