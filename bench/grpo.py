"""GRPO on the CPU: time per optimizer step, peak RSS and the reward's rise of gpupoor (`training.objective: grpo`)
and TRL's GRPOTrainer + peft, on the same real model, prompts, group, answer length, LoRA and rewards.

The model is the real tier's SmolLM2-135M-Instruct: `make fetch-real`'s GGUF, dequantized once to an fp32
transformers directory that both sides load (bench/compare_trl_real.py's build_real_fixture). The prompts are the
real GRPO demo's (recipes/smollm2-grpo.yaml, recipes/data/grpo-train.jsonl): a chat holding one worked example
and then a business sentence whose date is to be answered as YYYY-MM-DD; each side renders them with the model's
chat template (gpupoor's `format: chat`, TRL's conversational `prompt` column). An answer's reward is
1.0 x exact (the answer, spaces trimmed, equals the row's last assistant turn) + 0.5 x `regex:^\\d{4}-\\d{2}-\\d{2}$`:
gpupoor's scorers on one side, the same two functions written out for TRL on the other.

Both sides: LoRA r16 (alpha 32, all linear layers, no dropout), fp32, AdamW at a constant `--lr` (no warmup,
weight decay 0, gradient norm clipped at 1), no gradient checkpointing, `--prompts` prompts a step with `--group`
answers each (one micro-batch: TRL's per_device_train_batch_size counts answers, so prompts x group, and its
generation batch is that one step's), answers of at most `--new-tokens` tokens sampled at temperature 1, top_p 1,
top_k off, beta 0 (neither side runs a reference), epsilon 0.2, one update per sampled batch (the ratio is 1),
rewards scaled by the group's standard deviation, and the loss averaged over the step's answer tokens (gpupoor
`loss_normalization: token`; TRL `loss_type: dapo`, which normalises over the whole generation batch's tokens:
the same mean with one micro-batch a step and one process), for `--steps` steps. Every step samples and updates,
so a step's time is sampling + scoring + the update, for the same number of prompts and answers on both sides.

Per run: the step time is the median over the steps after the first two (warm-up); the peak RSS the whole
process's (its own VmHWM: loading included); the reward is the mean reward of the step's sampled answers, shown as
its mean over the first `--k` steps and over the last `--k` (what the run learned). The sides shuffle the same
prompts with their own seeds, so the rewards are close but not the same draws.

The sides alternate within every round (`--rounds`); every run is bracketed by bench/machine.py's matmul probe
(2048 x 2048 fp32, GFLOP/s), and a run whose lower probe fell more than 10% below the session's best is rejected
and repeated. Both sides get `--threads` threads (default: the cores this process may use): OMP_NUM_THREADS and
MKL_NUM_THREADS for both, and gpupoor's training.cpu_threads. The table is printed; the raw figures go to
build/bench/grpo/results.json. Nothing is written to docs/.

    python bench/grpo.py [--rounds 3] [--steps 20] [--prompts 2] [--group 4] [--new-tokens 16] [--lr 5e-4]
    python bench/grpo.py --quick      # one round of 3 steps of 2 prompts x 4 answers: does everything run?

Needs `pip install --no-deps trl==1.16.0` (not a dependency of gpupoor) and the real model (`make fetch-real`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import (alternate_rounds, fresh_run_dir, own_peak_rss_mb, probes_cell, run_in,  # noqa: E402
                     save_results, spread, step_timer, Steady, usable_cores)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "bench" / "grpo"
PROMPTS = ROOT / "recipes" / "data" / "grpo-train.jsonl"
TRL_WORKER = "--trl-worker"
RANK, BETA, EPSILON, WARM_UP = 16, 0.0, 0.2, 2
ISO_DATE = r"^\d{4}-\d{2}-\d{2}$"
REWARDS = [("exact", 1.0), (f"regex:{ISO_DATE}", 0.5)]  # gpupoor's scorers; trl_worker writes the same two
SIDES = ("gpupoor", "TRL GRPOTrainer + peft")


# ----------------------------------------------------------------------------------------------- the data
def real_model() -> Path:
    """The dequantized fp32 directory of the real model, fetched and written once (compare_trl_real's helper)."""
    from compare_trl_real import build_real_fixture

    return (build_real_fixture() / "model").resolve()


# ------------------------------------------------------------------------------------------- the runs
def gpupoor_run(model: Path, args, run_dir: Path) -> dict:
    recipe = run_dir.with_suffix(".yaml")
    recipe.write_text(json.dumps({
        "model": {"name_or_path": str(model)},
        "data": {"path": str(PROMPTS), "format": "chat", "max_length": 192, "sampler": "random"},
        "peft": {"rank": RANK, "alpha": 2 * RANK, "dropout": 0.0}, "precision": "fp32",
        "training": {"objective": "grpo", "micro_batch_size": args.prompts, "gradient_accumulation_steps": 1,
                     "max_steps": args.steps, "learning_rate": args.lr, "lr_scheduler": "constant",
                     "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0, "device": "cpu",
                     "cpu_threads": args.threads},
        "grpo": {"group_size": args.group, "max_new_tokens": args.new_tokens, "temperature": 1.0, "top_p": 1.0,
                 "beta": BETA, "epsilon": EPSILON, "iterations": 1, "loss_normalization": "token",
                 "scale_rewards": True, "rewards": [{"scorer": s, "weight": w} for s, w in REWARDS]},
        "checkpoint": {"every_minutes": 1000}, "logging": {"progress": "none", "every_steps": 1}, "seed": 0}))
    started = time.perf_counter()
    run_in([sys.executable, "-m", "gpupoor", "train", str(recipe), "--output-dir", str(run_dir)], ROOT)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "reward" in r and "step_s" in r]
    return summarise([r["step_s"] for r in steps], [r["reward"] for r in steps],
                     max(r["peak_mem_mb"] for r in steps), wall, args.k)


def trl_run(model: Path, args, run_dir: Path) -> dict:
    command = [sys.executable, __file__, TRL_WORKER, str(model), str(run_dir), json.dumps(
        {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "steps": args.steps,
         "lr": args.lr})]
    started = time.perf_counter()
    out = json.loads(run_in(command, ROOT).strip().splitlines()[-1])
    return {**summarise(out["step_s"], out["rewards"], out["peak_rss_mb"], time.perf_counter() - started, args.k),
            "trl_settings": out["effective"]}


def summarise(step_s: list[float], rewards: list[float], peak_rss_mb: float, wall_s: float, k: int) -> dict:
    if len(rewards) != len(step_s) or not step_s:
        raise SystemExit(f"a run logged {len(step_s)} step times and {len(rewards)} rewards: one of each per step "
                         "was expected")
    return {"step_s": statistics.median(step_s[WARM_UP:] or step_s), "peak_rss_mb": peak_rss_mb, "wall_s": wall_s,
            "reward_first": statistics.mean(rewards[:k]), "reward_last": statistics.mean(rewards[-k:]),
            "steps": len(step_s), "step_times": step_s, "rewards": rewards}


def trl_worker(model_dir: str, run_dir: str, settings: str) -> None:
    """One TRL GRPOTrainer + peft run in this process; prints its step times, per-step mean rewards and peak RSS
    as one JSON line."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads(settings)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line)["messages"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": m[:-1], "answer": m[-1]["content"]} for m in rows])
    pattern = re.compile(ISO_DATE)

    # gpupoor's `exact` and `regex:` scorers, on the answer's text (special tokens removed, as both sides decode)
    def exact(prompts, completions, answer, **_):
        return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]

    def iso_date(prompts, completions, **_):
        return [float(pattern.search(c[0]["content"]) is not None) for c in completions]

    times: list[float] = []
    rewards: list[float] = []

    class Rewards(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:  # logging_steps=1: each step's mean reward over its answers
                rewards.append(float(logs["reward"]))

    config = GRPOConfig(
        output_dir=run_dir, per_device_train_batch_size=s["prompts"] * s["group"], gradient_accumulation_steps=1,
        num_generations=s["group"], max_completion_length=s["new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=BETA, epsilon=EPSILON, num_iterations=1, loss_type="dapo", scale_rewards="group",
        reward_weights=[w for _, w in REWARDS], max_steps=s["steps"], learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, use_vllm=False,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0, log_completions=False)
    trainer = GRPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          reward_funcs=[exact, iso_date], callbacks=[step_timer(times), Rewards()],
                          peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()
    # What TRL made of the settings (results.json keeps it: a default that moved would show here)
    effective = {key: getattr(trainer.args, key) for key in (
        "loss_type", "generation_batch_size", "steps_per_generation", "num_generations", "scale_rewards",
        "gradient_checkpointing", "bf16", "top_k", "optim", "lr_scheduler_type")}
    effective["reference_model"] = trainer.ref_model is not None
    print(json.dumps({"step_s": times, "rewards": rewards, "peak_rss_mb": own_peak_rss_mb(),
                      "effective": {k: str(v) for k, v in effective.items()}}))


# -------------------------------------------------------------------------------------------- the driver
def measure(name: str, model: Path, args) -> dict:
    """One run of a side, in a run directory of its own (a repeated attempt gets a new one)."""
    run_dir = fresh_run_dir(OUT, SIDES.index(name))
    if name.startswith("TRL"):
        return trl_run(model, args, run_dir)
    return gpupoor_run(model, args, run_dir)


def render(results: dict, steady: Steady, args) -> str:
    lines = [f"GRPO, SmolLM2-135M-Instruct (fp32), LoRA r{RANK}, {args.prompts} prompts x {args.group} answers of "
             f"up to {args.new_tokens} tokens a step, beta {BETA:g}, token-normalised loss, {args.steps} steps, "
             f"{args.threads} threads, {args.rounds} round(s): median (min-max)", "",
             f"| side | s per step | peak RSS MB | wall s | reward, first {args.k} steps -> last {args.k} | "
             "GFLOP/s before/after |", "|---|---:|---:|---:|---|---|"]
    for name in SIDES:
        runs = results[name]
        lines.append(f"| {name} | {spread([r['step_s'] for r in runs], '{:.2f}')} | "
                     f"{spread([r['peak_rss_mb'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['wall_s'] for r in runs], '{:.1f}')} | "
                     f"{spread([r['reward_first'] for r in runs], '{:.2f}')} -> "
                     f"{spread([r['reward_last'] for r in runs], '{:.2f}')} | {probes_cell(runs)} |")
    return "\n".join(lines + ["", steady.summary(), *steady.notes()])


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "peft", "trl", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "missing"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=2, help="prompts a step (gpupoor's micro_batch_size)")
    parser.add_argument("--group", type=int, default=4, help="answers sampled to each prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="the longest answer, in tokens")
    parser.add_argument("--lr", type=float, default=5e-4, help="the demo's (recipes/smollm2-grpo.yaml)")
    parser.add_argument("--k", type=int, default=5, help="steps averaged for the reward's first and last figure")
    parser.add_argument("--threads", type=int, default=None, help="threads for both sides (default: usable cores)")
    parser.add_argument("--quick", action="store_true", help="one round of 3 steps at a tiny size")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.prompts, args.group, args.k = 1, 3, 2, 4, 1
    args.threads = args.threads or usable_cores()
    if args.steps <= WARM_UP or args.k < 1 or args.k > args.steps:
        parser.error(f"--steps {args.steps} and --k {args.k}: give more than {WARM_UP} steps (the first {WARM_UP} "
                     "are warm-up) and a k from 1 to the steps")
    if versions()["trl"] == "missing":
        raise SystemExit("TRL is not installed: pip install --no-deps trl==1.16.0")
    # Inherited by every process the sides start (and by the probe's, which sets its threads too)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = real_model()
    steady = Steady(threads=args.threads)
    steady.warm_up()
    results = alternate_rounds(steady, SIDES, args.rounds, lambda name: measure(name, model, args),
                               lambda r: f"{r['step_s']:.2f} s/step, {r['peak_rss_mb']:.0f} MB, reward "
                                         f"{r['reward_first']:.2f} -> {r['reward_last']:.2f}", swap_order=True)
    save_results(OUT, args, results, steady, versions=versions(), model=str(model))
    print(render(results, steady, args))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == TRL_WORKER:
        trl_worker(*sys.argv[2:])
    else:
        main()
