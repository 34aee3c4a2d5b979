"""DPO on the CPU: time per optimizer step and peak RSS of gpupoor with the adapter-off reference, gpupoor with a
frozen reference copy, and TRL's DPOTrainer + peft, on the same pairs, model, batch and lengths.

The model is the peer kit's fixture (`fixture.py`: a random-weight Llama with a BPE tokenizer trained on CPython's
docs); the pairs are cut from its rows: prompt = instruction + "\\n" + input + "\\n", chosen = the row's output,
rejected = the output of another row, each cut (by words) so that prompt + answer fits `--seq` tokens with room
to spare: neither tool truncates anything, so both see the same tokens. Every configuration trains LoRA r16
(alpha 32, all linear layers, no dropout) in fp32 with AdamW, `--batch` pairs per micro-batch, padded batches (TRL
pads; gpupoor's `random` sampler), no gradient checkpointing, beta 0.1, sigmoid loss, for `--steps` steps; the
step time is the median over the steps after the first two (warm-up), the peak RSS the whole process's
(its own VmHWM: loading included).

- `gpupoor, adapter off`: preference.reference adapter_off (the default with an adapter).
- `gpupoor, reference copy`: preference.reference copy (a second, frozen copy of the base in memory).
- `TRL DPOTrainer + peft`: DPOTrainer(model, ref_model=None, peft_config=LoraConfig(...)): TRL's reference for an
  adapter is also the base with the adapter disabled.

The configurations alternate within every round (`--rounds`); every run is bracketed by bench/machine.py's matmul
probe (2048 x 2048 fp32, GFLOP/s), and a run whose lower probe fell more than 10% below the session's best is
rejected and repeated. The table is printed; the raw figures go to build/bench/dpo/results.json. Nothing is
written to docs/.

    python bench/dpo.py [--rounds 3] [--steps 12] [--batch 4] [--seq 256] [--rows 160] [--kit ../shared/bench]
    python bench/dpo.py --quick      # one round of 3 steps at a tiny size: does everything run?

Needs `pip install trl` (not a dependency of gpupoor).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import (alternate_rounds, fresh_run_dir, own_peak_rss_mb, probes_cell, run_in,  # noqa: E402
                     save_results, spread, step_timer, Steady)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "bench" / "dpo"
TRL_WORKER = "--trl-worker"
RANK, BETA, LEARNING_RATE = 16, 0.1, 5e-5
CONFIGS = ("gpupoor, adapter off", "gpupoor, reference copy", "TRL DPOTrainer + peft")


# ----------------------------------------------------------------------------------------------- the data
def build_fixture(kit: Path, rows: int, hidden: int, layers: int, vocab: int) -> Path:
    """The kit's fixture, cached under build/bench/dpo/."""
    fixture = OUT / f"fixture-h{hidden}-l{layers}-v{vocab}-r{rows}"
    if not (fixture / "fixture.json").is_file():  # written last: a build that was cut off is built again
        out = subprocess.run([sys.executable, str(kit / "fixture.py"), str(fixture), "--rows", str(rows),
                              "--hidden", str(hidden), "--layers", str(layers), "--vocab", str(vocab)],
                             capture_output=True, text=True, check=True)
        (fixture / "fixture.json").write_text(out.stdout.strip().splitlines()[-1] + "\n")
    return fixture


def write_pairs(fixture: Path, seq: int) -> Path:
    """pairs.jsonl: prompt, chosen (the row's output), rejected (another row's output), cut by words so that
    prompt + answer + EOS stay within 7/8 of `seq` tokens (no truncation by either tool)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixture / "model")
    rows = [json.loads(line) for line in (fixture / "data.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    budget = seq * 7 // 8

    def fit(text: str, tokens: int) -> str:
        words = text.split()
        while words and len(tokenizer(" ".join(words), add_special_tokens=False).input_ids) > tokens:
            words = words[: max(1, len(words) * 3 // 4)] if len(words) > 1 else []
        return " ".join(words)

    pairs = []
    for index, row in enumerate(rows):
        prompt = fit(row["instruction"] + "\n" + row["input"], budget // 2) + "\n"
        room = budget - len(tokenizer(prompt).input_ids) - 1
        other = rows[(index + rng.randrange(1, len(rows))) % len(rows)]["output"]
        chosen, rejected = fit(row["output"], room), fit(other, room)
        if chosen and rejected and chosen != rejected:
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path = fixture / f"pairs-{seq}.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return path


# ------------------------------------------------------------------------------------------- the runs
def gpupoor_run(fixture: Path, pairs: Path, reference: str, args, run_dir: Path) -> dict:
    recipe = run_dir.with_suffix(".yaml")
    recipe.write_text(json.dumps({
        "model": {"name_or_path": str(fixture / "model")},
        "data": {"path": str(pairs), "format": "preference", "max_length": args.seq, "sampler": "random"},
        "peft": {"rank": RANK, "alpha": 2 * RANK}, "precision": "fp32",
        "training": {"objective": "dpo", "micro_batch_size": args.batch, "max_steps": args.steps,
                     "learning_rate": LEARNING_RATE, "warmup_steps": 0, "device": "cpu"},
        "preference": {"beta": BETA, "reference": reference},
        "checkpoint": {"every_minutes": 1000}, "logging": {"progress": "none"}, "seed": 0}))
    started = time.perf_counter()
    run_in([sys.executable, "-m", "gpupoor", "train", str(recipe), "--output-dir", str(run_dir)], ROOT)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    return {"step_s": statistics.median(r["step_s"] for r in steps[2:] or steps),
            "peak_rss_mb": max(r["peak_mem_mb"] for r in steps), "wall_s": wall,
            "tokens_per_step": statistics.median(r["tokens"] for r in steps), "loss": steps[-1]["loss"]}


def trl_run(fixture: Path, pairs: Path, args, run_dir: Path) -> dict:
    command = [sys.executable, __file__, TRL_WORKER, str(fixture), str(pairs), str(run_dir), str(args.batch),
               str(args.seq), str(args.steps)]
    started = time.perf_counter()
    out = run_in(command, ROOT)
    return {**json.loads(out.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}


def trl_worker(fixture: str, pairs: str, run_dir: str, batch: str, seq: str, steps: str) -> None:
    """One TRL DPOTrainer + peft run in this process; prints its step time and peak RSS as one JSON line."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(f"{fixture}/model")
    model = AutoModelForCausalLM.from_pretrained(f"{fixture}/model", dtype=torch.float32)
    times: list[float] = []
    config = DPOConfig(output_dir=run_dir, per_device_train_batch_size=int(batch), max_length=int(seq),
                       max_steps=int(steps), learning_rate=LEARNING_RATE, beta=BETA, loss_type=["sigmoid"],
                       logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
                       dataloader_num_workers=0, disable_tqdm=True, seed=0, lr_scheduler_type="cosine")
    trainer = DPOTrainer(model=model, args=config, train_dataset=load_dataset("json", data_files=pairs, split="train"),
                         processing_class=tokenizer, callbacks=[step_timer(times)],
                         peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                                target_modules="all-linear", task_type="CAUSAL_LM"))
    out = trainer.train()
    print(json.dumps({"step_s": statistics.median(times[2:] or times), "loss": out.training_loss,
                      "peak_rss_mb": own_peak_rss_mb()}))


# -------------------------------------------------------------------------------------------- the driver
def measure(name: str, fixture: Path, pairs: Path, args) -> dict:
    """One run of a configuration, in a run directory of its own (a repeated attempt gets a new one)."""
    run_dir = fresh_run_dir(OUT, CONFIGS.index(name))
    if name.startswith("TRL"):
        return trl_run(fixture, pairs, args, run_dir)
    return gpupoor_run(fixture, pairs, "copy" if "copy" in name else "adapter_off", args, run_dir)

def render(results: dict, steady: Steady, args) -> str:
    lines = [f"DPO, LoRA r{RANK}, {args.batch} pairs x up to {args.seq} tokens per sequence, padded, fp32, no "
             f"checkpointing, {args.steps} steps, {args.rounds} round(s): median (min-max)", "",
             "| configuration | s per step | peak RSS MB | wall s | GFLOP/s before/after |", "|---|---:|---:|---:|---|"]
    for name in CONFIGS:
        runs = results[name]
        lines.append(f"| {name} | {spread([r['step_s'] for r in runs], '{:.3f}')} | "
                     f"{spread([r['peak_rss_mb'] for r in runs], '{:.0f}')} | {spread([r['wall_s'] for r in runs], '{:.1f}')} "
                     f"| {probes_cell(runs)} |")
    return "\n".join(lines + ["", steady.summary(), *steady.notes()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--quick", action="store_true", help="one round of 3 steps on a tiny fixture")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.batch, args.seq, args.rows, args.hidden, args.layers, args.vocab = \
            1, 3, 2, 128, 24, 64, 2, 2000
    fixture = build_fixture(args.kit, args.rows, args.hidden, args.layers, args.vocab)
    pairs = write_pairs(fixture, args.seq)
    steady = Steady()
    steady.warm_up()
    results = alternate_rounds(steady, CONFIGS, args.rounds, lambda name: measure(name, fixture, pairs, args),
                               lambda r: f"{r['step_s']:.3f} s/step, {r['peak_rss_mb']:.0f} MB")
    save_results(OUT, args, results, steady)
    print(render(results, steady, args))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == TRL_WORKER:
        trl_worker(*sys.argv[2:])
    else:
        main()
