"""gpupoor on a CUDA GPU: `gpupoor plan` against the measured peak, and gpupoor vs TRL SFTTrainer + peft, on
random-weight models of two real architectures. Run on the device machine when a session is lent one; the
figures go to docs/benchmarks.md (section gpu).

The models: SmolLM2-135M's architecture (the real tier's model: llama, 30 layers, width 576, GQA 9/3, vocab
49,152) and Qwen2.5-1.5B's (the shipped recipe recipes/qwen2.5-1.5b-lora.yaml: 28 layers, width 1536, GQA 12/2,
vocab 151,936), with random bf16 weights and SmolLM2's tokenizer (its ids are valid in both vocabularies). Random
weights change neither the time nor the memory of a step; the real weights cannot travel to the device machine
(the GGUF alone is over its transfer limit). The data: alpaca rows cut from Python's own documentation
(pydoc_data), 30-400 words each, the same prompt/completion text on both sides.

    python bench/gpu.py build --arch-dir DIR     # DIR: SmolLM2's config.json and tokenizer files
    python bench/gpu.py plan --out DIR           # the plan rows: every recipe trains at once, one process each
    python bench/gpu.py speed --out DIR [--rounds 2]
    python bench/gpu.py render DIR               # here: the JSON the device wrote -> docs/benchmarks.md

GPU_BENCH_DRY=1 runs every step on the CPU with 2 layers of each architecture and a few rows (under
build/gpu-bench-dry): the check before spending a lease, not a measurement.

On CUDA gpupoor measures (metrics' peak_mem_mb) and plans (the plan's peak without the CUDA context and the
allocator's slack) the tensors torch allocated, so that is what the plan rows compare, and what the TRL script
reports too (bench/peer_trl_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import read_metrics  # noqa: E402
from machine import ROOT, spread, write_recipe, write_section  # noqa: E402

DRY = os.environ.get("GPU_BENCH_DRY") == "1"
WORK = ROOT / "build" / ("gpu-bench-dry" if DRY else "gpu-bench")
ROWS = 48 if DRY else 1200
SEQ, BATCH, RANK = (128 if DRY else 1024), 8, 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
ARCHS = {"smollm2-135m": None,  # --arch-dir's config.json
         "qwen2.5-1.5b": ROOT / "gpupoor" / "model" / "model_configs" / "Qwen--Qwen2.5-1.5B.json",
         "llama-3.1-8b": ROOT / "gpupoor" / "model" / "model_configs" / "meta-llama--Llama-3.1-8B.json"}
DEFAULT_ARCHS = ("smollm2-135m", "qwen2.5-1.5b")  # the flagship's 16 GB are built only for `flagship`
PLAN_STEPS = 2 if DRY else 6  # the peak settles within the first few steps
PLAN_RECIPES = {  # name: (arch, what changes, recipe keys)
    "135m-8x1024": ("smollm2-135m", "LoRA r16, packed 8 x 1024", {}),
    "135m-8x1024-ckpt": ("smollm2-135m", "+ gradient checkpointing", {"memory.gradient_checkpointing": True}),
    "135m-full-4x1024": ("smollm2-135m", "full fine-tuning, micro-batch 4",
                         {"peft.method": "full", "training.micro_batch_size": 4}),
    # the settings of the "memory plan on paper" table below (there: random order, rows of 1024 tokens)
    "1.5b-1x1024": ("qwen2.5-1.5b", "LoRA r16, packed 1 x 1024", {"training.micro_batch_size": 1}),
    "1.5b-1x1024-ckpt": ("qwen2.5-1.5b", "+ gradient checkpointing",
                         {"training.micro_batch_size": 1, "memory.gradient_checkpointing": True}),
    "1.5b-8x1024": ("qwen2.5-1.5b", "LoRA r16, packed 8 x 1024", {}),
    "1.5b-8x1024-ckpt": ("qwen2.5-1.5b", "+ gradient checkpointing", {"memory.gradient_checkpointing": True}),
    "1.5b-4x2048-ckpt-offload": ("qwen2.5-1.5b", "4 x 2048, checkpoints offloaded to CPU memory",
                                 {"memory.gradient_checkpointing": "offload", "data.max_length": 2 * SEQ,
                                  "training.micro_batch_size": 4}),
    "1.5b-nf4-8x1024-ckpt": ("qwen2.5-1.5b", "QLoRA: nf4 base, double quant, checkpointing",
                             {"quantization.bits": 4, "memory.gradient_checkpointing": True}),
}
SPEED_SIDES = {  # arch: sides, each (tool, gradient checkpointing)
    "smollm2-135m": [("gpupoor", False), ("trl", False)],
    "qwen2.5-1.5b": [("gpupoor", False), ("trl", False)],
}
# The timed rows (`mfu`, `times`, `flagship`): each trains alone, one process after another, and keeps every step's
# time, so the MFU and the time plan (issue #43) read the same runs. name: (arch, what, recipe keys, environment)
MFU_STEPS = 3 if DRY else 20
MFU_ROWS = {  # each row changes one thing against gpupoor's default on a GPU (fused MLP, one masked sdpa call)
    "1.5b-8x1024": ("qwen2.5-1.5b", "LoRA r16, packed 8 x 1024, as gpupoor chooses on a GPU", {}, {}),
    "1.5b-8x1024-plain": ("qwen2.5-1.5b", "model.fused_layers: false (peft's LoRA linears, transformers' MLP)",
                          {"model.fused_layers": False}, {}),
    "1.5b-8x1024-liger": ("qwen2.5-1.5b", "model.kernels: liger (RMSNorm, RoPE; the MLP stays fused)",
                          {"model.kernels": "liger"}, {}),
    "1.5b-8x1024-compile": ("qwen2.5-1.5b", "model.compile: true (each decoder layer)", {"model.compile": True}, {}),
}
TIME_STEPS = 3 if DRY else 12
TIME_ROWS = {
    "1.5b-8x1024-ckpt": ("qwen2.5-1.5b", "LoRA r16, 8 x 1024, gradient checkpointing",
                         {"memory.gradient_checkpointing": True}, {}),
    "1.5b-nf4-8x1024-ckpt": ("qwen2.5-1.5b", "QLoRA nf4, 8 x 1024, gradient checkpointing",
                             {"quantization.bits": 4, "memory.gradient_checkpointing": True}, {}),
    "135m-8x1024": ("smollm2-135m", "LoRA r16, packed 8 x 1024", {}, {}),
    "135m-full-4x1024": ("smollm2-135m", "full fine-tuning, micro-batch 4",
                         {"peft.method": "full", "training.micro_batch_size": 4}, {}),
}
FLAGSHIP_STEPS = 2 if DRY else 5
FLAGSHIP_ROWS = {
    f"8b-nf4-{batch}x2048-ckpt": ("llama-3.1-8b", f"NF4 QLoRA r16, double quant, checkpointing, {batch} x 2048",
                                  {"quantization.bits": 4, "memory.gradient_checkpointing": True,
                                   "training.micro_batch_size": batch, "data.max_length": 2 * SEQ}, {})
    for batch in (1, 2)}
DRY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64}
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def build(arch_dir: Path, archs=DEFAULT_ARCHS) -> None:
    """build/gpu-bench/ARCH/model (random bf16 weights, SmolLM2's tokenizer) and the data files beside them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for arch in archs:
        config_path, target = ARCHS[arch], WORK / arch
        if (target / "ready").is_file():
            continue
        shutil.rmtree(target, ignore_errors=True)
        raw = json.loads((config_path or arch_dir / "config.json").read_text())
        raw = {k: v for k, v in raw.items() if not k.startswith("_")}
        config = AutoConfig.for_model(**{**raw, **DRY_SHAPE} if DRY else raw)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(target / "model")
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        for name in TOKENIZER_FILES:
            if (arch_dir / name).is_file():
                shutil.copy(arch_dir / name, target / "model" / name)
        write_data(target)
        (target / "ready").write_text("")
        print(f"built {target}", flush=True)


def write_data(target: Path) -> None:
    from pydoc_data.topics import topics

    words = " ".join(" ".join(text.split()) for _, text in sorted(topics.items())).split()
    rng = random.Random(0)
    rows = []
    for _ in range(ROWS):
        start = rng.randrange(len(words) - 500)
        length = rng.randint(30, 400)
        rows.append({"instruction": "Continue the Python reference text.", "input": " ".join(words[start:start + 20]),
                     "output": " ".join(words[start + 20:start + 20 + length])})
    (target / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the peer's prompt is instruction + "\n" + input + "\n": gpupoor trains on that very text
    (target / "prompt-completion.jsonl").write_text("".join(
        json.dumps({"prompt": r["instruction"] + "\n" + r["input"] + "\n", "completion": r["output"]}) + "\n"
        for r in rows))


def recipe(arch: str, name: str, keys: dict) -> Path:
    settings = {"model.name_or_path": str(WORK / arch / "model"),
                "data.path": str(WORK / arch / "prompt-completion.jsonl"), "data.format": "completion",
                "data.max_length": SEQ, "data.sampler": "packed", "peft.rank": RANK, "peft.alpha": 2 * RANK,
                "precision": "fp32" if DRY else "bf16", "training.device": "cpu" if DRY else "cuda",
                "training.micro_batch_size": BATCH,
                "training.epochs": 1, "training.learning_rate": 2.0e-4, "checkpoint.every_minutes": 1000,
                "logging.progress": "none", **keys}
    return write_recipe(WORK / "recipes" / f"{name}.yaml", settings)


def gpupoor(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpupoor", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **ENV}, **kwargs)


def plan_rows(out: Path, only: list[str]) -> None:
    """Every plan recipe trains PLAN_STEPS steps, all at once (each process measures its own allocations, so
    running side by side changes no peak), then `gpupoor plan --json` predicts it."""
    processes = {}
    for name, (arch, _, keys) in PLAN_RECIPES.items():
        if only and name not in only:
            continue
        run_dir = WORK / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        path = recipe(arch, name, {**keys, "training.max_steps": PLAN_STEPS})
        processes[name] = subprocess.Popen([sys.executable, "-m", "gpupoor", "train", str(path), "--output-dir",
                                            str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, env={**os.environ, **ENV})
    rows = []
    for name, process in processes.items():
        output, _ = process.communicate()
        row = {"name": name, "arch": PLAN_RECIPES[name][0], "what": PLAN_RECIPES[name][1]}
        if process.returncode != 0:
            row["error"] = output[-1500:]
        else:
            peaks = [r["peak_mem_mb"] for r in read_metrics(WORK / "runs" / name)[1]]
            plan = json.loads(gpupoor("plan", WORK / "recipes" / f"{name}.yaml", "--json").stdout)
            predicted = (plan["peak_bytes"] - plan["terms"]["overhead"]["bytes"]) / 2**20
            row.update(predicted_mb=predicted, measured_mb=max(peaks), peaks=peaks,
                       terms={k: v["bytes"] / 2**20 for k, v in plan["terms"].items()})
            print(f"{name:26s} predicted {predicted:8.0f} MiB  measured {max(peaks):8.0f} MiB  "
                  f"error {predicted / max(peaks) - 1:+.1%}", flush=True)
        if "error" in row:
            print(f"{name}: FAILED\n{row['error']}", flush=True)
        rows.append(row)
    (out / "gpu-plan.json").write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))


def timed_rows(out: Path, rows: dict, steps: int, file: str) -> None:
    """Each row trains `steps` steps alone, then `gpupoor plan --json` predicts it; every step's time kept. The
    JSON is written after each row, so a row cut off by the lease keeps those before it."""
    results = []
    for name, (arch, what, keys, env) in rows.items():
        run_dir = WORK / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        path = recipe(arch, name, {**keys, "training.max_steps": steps})
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gpupoor", "train", str(path), "--output-dir", str(run_dir)],
                              capture_output=True, text=True, env={**os.environ, **ENV, **env})
        row = {"name": name, "arch": arch, "what": what, "keys": keys, "env": env,
               "wall_s": time.perf_counter() - started}
        if done.returncode != 0:
            row["error"] = (done.stdout + done.stderr)[-2500:]
            print(f"{name}: FAILED\n{row['error']}", flush=True)
        else:
            start, metrics = read_metrics(run_dir)
            plan = json.loads(gpupoor("plan", path, "--json").stdout)
            step_s = [m["step_s"] for m in metrics]
            settled = statistics.median(step_s[len(step_s) // 2:])
            row.update(startup_s=start.get("startup_s"), step_s=step_s, tokens=[m["tokens"] for m in metrics],
                       target_tokens=[m["target_tokens"] for m in metrics],
                       peaks=[m["peak_mem_mb"] for m in metrics], settled_step_s=settled,
                       predicted_mb=(plan["peak_bytes"] - plan["terms"]["overhead"]["bytes"]) / 2**20,
                       summary=[line for line in done.stdout.splitlines() if line.startswith("  ")][:14])
            tokens = statistics.median(row["tokens"])
            print(f"{name:24s} step {settled:.3f} s (first {step_s[0]:.2f} s) {tokens / settled:9,.0f} tokens/s  "
                  f"peak {max(row['peaks']):7.0f} MiB planned {row['predicted_mb']:7.0f}  wall {row['wall_s']:.0f} s",
                  flush=True)
        results.append(row)
        (out / file).write_text(json.dumps({"device": device_name(), "steps": steps, "rows": results}, indent=1))


def run_side(arch: str, tool: str, checkpointing: bool) -> dict:
    started = time.perf_counter()
    if tool == "gpupoor":
        run_dir = WORK / "runs" / f"speed-{arch}{'-gc' if checkpointing else ''}"
        shutil.rmtree(run_dir, ignore_errors=True)
        path = recipe(arch, f"speed-{arch}{'-gc' if checkpointing else ''}",
                      {"memory.gradient_checkpointing": checkpointing})
        done = gpupoor("train", path, "--output-dir", run_dir)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-1500:]}
        _, steps = read_metrics(run_dir)
        tokens = sum(s["tokens"] for s in steps)
        return {"train_s": steps[-1]["elapsed_s"], "wall_s": wall, "peak_mb": max(s["peak_mem_mb"] for s in steps),
                "tokens": tokens, "tokens_per_s": tokens / steps[-1]["elapsed_s"],
                "loss": statistics.fmean(s["loss"] for s in steps)}
    command = [sys.executable, str(ROOT / "bench" / "peer_trl_gpu.py"), str(WORK / arch), "--epochs", "1",
               "--batch", str(BATCH), "--seq", str(SEQ), "--rank", str(RANK), "--packing"]
    done = subprocess.run(command + (["--gc"] if checkpointing else []), capture_output=True, text=True,
                          env={**os.environ, **ENV})
    wall = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stdout + done.stderr)[-1500:]}
    peer = json.loads(lines[-1])
    return {"train_s": peer["seconds"], "wall_s": wall, "peak_mb": peer["peak_cuda_mb"], "tokens": peer["tokens"],
            "tokens_per_s": peer["tokens_per_s"], "loss": peer["loss"]}


def speed(out: Path, rounds: int, archs: list[str]) -> None:
    """Each arch's sides in alternating rounds (the order rotates), one process at a time; results are written
    after every run, so a run cut off by the lease keeps what finished."""
    results: dict = {"device": device_name(), "rounds": rounds, "runs": []}
    for arch, sides in SPEED_SIDES.items():
        if archs and arch not in archs:
            continue
        for round_index in range(rounds):
            shift = round_index % len(sides)
            for tool, checkpointing in sides[shift:] + sides[:shift]:
                result = {"arch": arch, "tool": tool, "gc": checkpointing, "round": round_index + 1,
                          **run_side(arch, tool, checkpointing)}
                results["runs"].append(result)
                (out / "gpu-speed.json").write_text(json.dumps(results, indent=1))
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}),
                      flush=True)


def device_name() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}" if torch.cuda.is_available() else "cpu"


def render(folder: Path) -> None:
    """docs/benchmarks.md's gpu section from the JSON files the device machine wrote."""
    plan = json.loads((folder / "gpu-plan.json").read_text()) if (folder / "gpu-plan.json").is_file() else None
    speed_ = json.loads((folder / "gpu-speed.json").read_text()) if (folder / "gpu-speed.json").is_file() else None
    from gpupoor import __version__

    lines = [f"Measured on the device machine a session was lent ({(speed_ or plan)['device']}; 16 CPU cores), "
             f"{time.strftime('%Y-%m-%d')}, gpupoor {__version__}. Models: random bf16 weights in the architectures of "
             "SmolLM2-135M (llama, 30 layers, width 576, GQA 9/3, vocab 49,152) and Qwen2.5-1.5B (28 layers, width "
             "1536, GQA 12/2, vocab 151,936), SmolLM2's tokenizer; data: alpaca rows cut from Python's documentation "
             f"({ROWS} rows, 30-400 words). bf16, LoRA r{RANK} on every linear layer, packed rows of {SEQ} tokens, "
             f"micro-batch {BATCH}, SDPA attention (flash-attn is not installed there). Commands: `python "
             "bench/gpu.py build|plan|speed` (bench/gpu.py says how the model files got there)."]
    if speed_:
        lines += ["", f"#### gpupoor vs TRL SFTTrainer + peft (bench/peer_trl_gpu.py), one epoch, "
                  f"median (min-max) of {speed_['rounds']} alternating rounds", "",
                  "| model | side | training s | whole process s | tokens/s | peak allocated MiB | mean loss |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        groups: dict = {}
        for run in speed_["runs"]:
            groups.setdefault((run["arch"], run["tool"], run["gc"]), []).append(run)
        for (arch, tool, gc), runs in groups.items():
            good = [r for r in runs if "error" not in r]
            side = ("gpupoor" if tool == "gpupoor" else "TRL") + (" + gradient checkpointing" if gc else "")
            if not good:
                lines.append(f"| {arch} | {side} | failed: {runs[0]['error'].splitlines()[-1][:120]} | | | | |")
                continue
            lines.append(f"| {arch} | {side} | {spread([r['train_s'] for r in good], '{:.1f}')} | "
                         f"{spread([r['wall_s'] for r in good], '{:.1f}')} | "
                         f"{statistics.median(r['tokens_per_s'] for r in good):,.0f} | "
                         f"{statistics.median(r['peak_mb'] for r in good):,.0f} | "
                         f"{statistics.median(r['loss'] for r in good):.3f} |")
        ratios = []
        for (arch, tool, gc), runs in groups.items():
            peer = groups.get((arch, "trl", gc))
            if tool != "gpupoor" or not peer:
                continue
            ours = [r for r in runs if "error" not in r]
            theirs = [r for r in peer if "error" not in r]
            if ours and theirs:
                speedup = statistics.median(r["train_s"] for r in theirs) / statistics.median(
                    r["train_s"] for r in ours)
                their_peak = statistics.median(r["peak_mb"] for r in theirs)  # 0 on a CPU dry run
                memory = statistics.median(r["peak_mb"] for r in ours) / their_peak if their_peak else float("nan")
                ratios.append(f"- {arch}{', gradient checkpointing' if gc else ''}: gpupoor trains "
                              f"{speedup:.2f}x TRL's speed at {memory:.2f}x its peak allocated memory.")
        lines += ["", *ratios]
    if plan:
        lines += ["", f"#### `gpupoor plan` against the measured peak on CUDA ({PLAN_STEPS} steps each)", "",
                  "| recipe | model | what | predicted MiB | measured MiB | error | peak after each step MiB |",
                  "|---|---|---|---:|---:|---:|---|"]
        for row in plan["rows"]:
            if "error" in row:
                lines.append(f"| {row['name']} | {row['arch']} | {row['what']} | failed: "
                             f"{row['error'].strip().splitlines()[-1][:120]} | | | |")
                continue
            lines.append(f"| {row['name']} | {row['arch']} | {row['what']} | {row['predicted_mb']:.0f} | "
                         f"{row['measured_mb']:.0f} | {row['predicted_mb'] / row['measured_mb'] - 1:+.1%} | "
                         f"{', '.join(f'{p:.0f}' for p in row['peaks'])} |")
    write_section(ROOT / "docs" / "benchmarks.md", "gpu", "\n".join(lines))


TIMED_FILES = (("gpu-mfu.json", "MFU rows: Qwen2.5-1.5B's architecture, LoRA r16, bf16, packed 8 x 1024, "
                 f"{MFU_STEPS} steps"),
               ("gpu-flagship.json", f"The flagship: Llama-3.1-8B's architecture, NF4 QLoRA, {FLAGSHIP_STEPS} steps"),
               ("gpu-times.json", f"More rows for the time plan, {TIME_STEPS} steps"))
H100_PEAK = 989.4e12  # NVIDIA's H100 SXM5 datasheet: dense BF16 tensor-core TFLOP/s


def render_timed(folder: Path) -> None:
    """docs/benchmarks.md's gpu-timed section from the timed rows' JSON (`mfu`, `flagship`, `times`). MFU =
    tokens/s x model FLOPs per token (gpupoor.plan.time.work.model_flops_per_token: 4 x the base's linear and head
    weights + 6 x LoRA's + causal attention at the data's mean example length) / the H100's 989.4 TFLOP/s."""
    from gpupoor.plan.time.work import model_flops_per_token
    from gpupoor.plan.settings import resolve_settings
    from gpupoor.model.shape import load_shape
    from gpupoor.recipe.loading import load_recipe

    device = None
    lines = []
    for file, title in TIMED_FILES:
        if not (folder / file).is_file():
            continue
        data = json.loads((folder / file).read_text())
        device = data["device"]
        lines += ["", f"#### {title}", "", "| row | what | step s (median, 2nd half) | first step s | tokens/s | MFU | "
                  "peak allocated MiB | planned MiB | plan error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in data["rows"]:
            if "error" in row:
                lines.append(f"| {row['name']} | {row['what']} | failed: {row['error'].strip().splitlines()[-1][:100]} "
                             "| | | | | | |")
                continue
            loaded = load_recipe(recipe(row["arch"], row["name"], {**row["keys"], "training.max_steps": 1}), [])
            shape, _ = load_shape(loaded)
            settings = resolve_settings(loaded.recipe, "cuda", shape)
            examples = [json.loads(line) for line in (WORK / row["arch"] / "prompt-completion.jsonl").open()]
            words = statistics.fmean(len((e["prompt"] + e["completion"]).split()) for e in examples)
            tokens = statistics.median(row["tokens"]) / row["settled_step_s"]
            mfu = tokens * model_flops_per_token(shape, settings, seq=1.3 * words) / H100_PEAK
            peak = max(row["peaks"])
            env = ", ".join(f"{k}={v}" for k, v in row["env"].items())
            lines.append(f"| {row['name']} | {row['what']}{f' ({env})' if env else ''} | {row['settled_step_s']:.3f} | "
                         f"{row['step_s'][0]:.2f} | {tokens:,.0f} | {mfu:.1%} | {peak:,.0f} | "
                         f"{row['predicted_mb']:,.0f} | {row['predicted_mb'] / peak - 1:+.1%} |")
    header = (f"Measured on the device machine a session was lent ({device}; 16 CPU cores), from "
              f"`{folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder}`. Commands: `bash "
              "bench/gpu_session.sh` (stages `python bench/gpu.py build|flagship|mfu|times`), then here `python "
              "bench/gpu.py render-timed FOLDER`. Tokens: the data positions of a step (metrics' `tokens`); MFU: "
              "tokens/s x (4 x the base's linear and head weights + 6 x LoRA's + causal attention at the data's "
              "mean example length, ~1.3 tokens a word) / 989.4 TFLOP/s (H100 SXM5, dense bf16). Planned MiB: the "
              "plan made on the device then, which knew neither the fused MLP in bf16 on CUDA (behind a benchmark "
              "switch in that call, the default since: today's plan of that row is 17,915 MiB, -5.0%) nor Liger's "
              "kernels.")
    write_section(ROOT / "docs" / "benchmarks.md", "gpu-timed", header + "\n" + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["build", "plan", "speed", "mfu", "times", "flagship", "render",
                                         "render-timed"])
    parser.add_argument("folder", nargs="?", type=Path, help="render: the folder of the device's JSON files")
    parser.add_argument("--arch-dir", type=Path)
    parser.add_argument("--out", type=Path, default=WORK)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--archs", default="", help="speed: only these architectures (comma-separated)")
    parser.add_argument("--only", default="", help="plan: only these recipes (comma-separated)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "build":
        build(args.arch_dir)
    elif args.what == "mfu":
        timed_rows(args.out, {k: v for k, v in MFU_ROWS.items() if not args.only or k in args.only.split(",")},
                   MFU_STEPS, "gpu-mfu.json")
    elif args.what == "times":
        timed_rows(args.out, TIME_ROWS, TIME_STEPS, "gpu-times.json")
    elif args.what == "flagship":
        build(args.arch_dir, ["llama-3.1-8b"])
        timed_rows(args.out, FLAGSHIP_ROWS, FLAGSHIP_STEPS, "gpu-flagship.json")
    elif args.what == "plan":
        plan_rows(args.out, [n for n in args.only.split(",") if n])
    elif args.what == "speed":
        speed(args.out, args.rounds, [a for a in args.archs.split(",") if a])
    elif args.what == "render-timed":
        render_timed(args.folder.resolve())
    else:
        render(args.folder)


if __name__ == "__main__":
    main()
