"""Each fused decoder path on its own, on the real model: step time and peak memory of SmolLM2-135M-Instruct with
LoRA r16 on every linear layer, one packed micro-batch of 8 x 512 tokens of the real demo's rows, fp32, as the
plain transformers + peft modules and with each of gpupoor.model.fast_paths' parts switched on alone and together.

Every variant trains in a fresh process (its own peak RSS): the model is loaded, `--steps` optimizer steps run
on the same batch, and the median of the steps after the first is its step time. Variants alternate round by
round, bracketed by the matmul probe of bench/machine.py (a busy machine's runs are repeated).

    python bench/fused_layers.py [--rounds 2] [--threads 1] [--steps 4] [--checkpointing]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import ROOT, Steady, shown_command, spread, write_section  # noqa: E402

VARIANTS = {"plain": "plain transformers + peft modules (model.fused_layers: false)",
            "linear": "LoRA linears fused",
            "mlp": "LoRA linears + gated MLP fused",
            "attention": "attention per packed example only",
            "all": "all of them (model.fused_layers: true)"}
DEMO_ROWS = ROOT / "recipes" / "data" / "iso-dates-train.jsonl"


def packed_batch(tokenizer, rows: int = 8, length: int = 512):
    """The demo's examples end to end in `rows` rows of `length` tokens, position ids restarting per example
    (as gpupoor.data.build.collate_packed lays them), the last example of a row cut to fit; the replies are the
    targets (about a quarter of the tokens, as in gpupoor's runs of this data)."""
    import torch

    def encoded(messages, **options):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, **options)["input_ids"])

    def examples():
        for line in DEMO_ROWS.read_text().splitlines():
            messages = json.loads(line)["messages"]
            ids = encoded(messages)
            prompt = len(encoded(messages[:-1], add_generation_prompt=True))
            yield ids, [-100] * prompt + ids[prompt:]

    stream = examples()
    ids, labels, positions = [], [], []
    for _ in range(rows):
        row_ids, row_labels, row_positions = [], [], []
        while len(row_ids) < length:
            example_ids, example_labels = next(stream)
            room = length - len(row_ids)
            row_ids += example_ids[:room]
            row_labels += [-100] + example_labels[1:room]  # an example's first token is no target
            row_positions += range(len(example_ids[:room]))
        ids.append(row_ids)
        labels.append(row_labels)
        positions.append(row_positions)
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}


def one_variant(variant: str, steps: int, checkpointing: bool) -> dict:
    """Runs in the child process: load, install `variant`, train `steps` steps; step times and peak RSS."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpupoor.model.pretrained import dequantized_copy, real_model_path
    from gpupoor.model.fused_lora import fuse_lora_layers
    from gpupoor.objectives.cross_entropy import find_fused_head, fused_loss_sum
    from gpupoor.model.packed_attention import use_packed_attention

    model_dir = dequantized_copy(real_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.get_base_model().disable_input_require_grads()
    if variant in ("linear", "mlp", "all"):
        fuse_lora_layers(model.get_base_model(), mlp=variant != "linear")
    if variant in ("attention", "all"):
        use_packed_attention(model.get_base_model())
    batch = packed_batch(tokenizer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    head, _ = find_fused_head(model)  # gpupoor's chunked loss: the head costs what it costs in a gpupoor run
    targets = int((batch["labels"][:, 1:] != -100).sum())
    times, losses = [], []
    for _ in range(steps):
        started = time.perf_counter()
        loss = fused_loss_sum(model, batch, head) / targets
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    return {"step_s": statistics.median(times[1:]), "first_step_s": times[0], "losses": losses,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measured(variant: str, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    command = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps), "--threads", str(args.threads)]
    if args.checkpointing:
        command.append("--checkpointing")
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(results: dict, steady: Steady, args, command: str) -> str:
    plain = statistics.median(r["step_s"] for r in results["plain"])
    plain_rss = statistics.median(r["peak_rss_mb"] for r in results["plain"])
    lines = [f"### Each fused path alone: SmolLM2-135M, 8 x 512 packed, LoRA r16, fp32, {args.threads} thread"
             f"{'s' if args.threads > 1 else ''}{', gradient checkpointing' if args.checkpointing else ''}", "",
             f"`{command}` on {platform.machine()}, {time.strftime('%Y-%m-%d')}. Step time: median of steps 2-"
             f"{args.steps} in each run, median (min-max) over {args.rounds} alternating rounds; peak RSS of the "
             f"process. {steady.summary()}", "",
             "| variant | step s | vs plain | peak RSS MB | vs plain | losses of the steps (first run) |",
             "|---|---:|---:|---:|---:|---|"]
    for variant, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        losses = ", ".join(f"{x:.4f}" for x in runs[0]["losses"])
        lines.append(f"| {VARIANTS[variant]} | {spread([r['step_s'] for r in runs])} | {plain / step:.2f}x | "
                     f"{rss:,.0f} | {rss / plain_rss:.2f}x | {losses} |")
    notes = steady.notes()
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--attempts", type=int, default=3,
                        help="tries per run when the probe says the machine was busy (1: never repeat, flag it)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one_variant(args.child, args.steps, args.checkpointing)))
        return
    variants = args.variants.split(",")
    steady = Steady(threads=args.threads, attempts=args.attempts)
    print(f"matmul reference: {steady.warm_up():.0f} GFLOP/s", flush=True)
    results: dict[str, list[dict]] = {variant: [] for variant in variants}
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            result = steady.run(f"{variant}, round {round_index + 1}", lambda v=variant: measured(v, args))
            results[variant].append(result)
            print(f"round {round_index + 1} {variant}: step {result['step_s']:.2f} s, {result['peak_rss_mb']:.0f} MB"
                  f"{' (noisy)' if result['noisy'] else ''}", flush=True)
    command = shown_command("bench/fused_layers.py", sys.argv[1:])
    body = render(results, steady, args, command)
    write_section(Path(args.doc), f"fused-layers-t{args.threads}{'-gc' if args.checkpointing else ''}", body)
    print(body)


if __name__ == "__main__":
    main()
