"""Generation speed: gpupoor's decoding engine (gpupoor/model/decoding.py) against plain transformers `generate`
on the real SmolLM2-135M-Instruct (fp32), and llama.cpp when its binary is there (LLAMA_BENCH=path/to/llama-bench,
given the f32 GGUF in LLAMA_GGUF; the peers' anchor). Greedy, the same prompt, one process.

- single stream: the time to the first token (the prompt's prefill) and the decode rate (tokens/s after it);
- batched: --batches rows decoded together, tokens/s and the fraction of the machine's matmul rate that makes
  (2 x the weights read a token, per row: the arithmetic a decode step does).

The sides alternate round by round, each round bracketed by the matmul probe of bench/machine.py and a memory
bandwidth probe (a 256 MiB sum, one thread): a round whose probe fell is repeated (machine.Steady).

    python bench/generation.py [--rounds 3] [--threads 1] [--new 128] [--batches 8,16,32] [--write]
    python bench/generation.py --profile     # where a decoded token's time goes (linear layers vs the rest)
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
from machine import ROOT, Steady, shown_command, spread, write_section  # noqa: E402

PROMPT = ("Rewrite the date 3 March 2021 in ISO 8601 form, then explain in a few sentences why a fixed date format "
          "helps when files are sorted by name, and what goes wrong with day-first and month-first dates.")


def bandwidth_gbs(size_mib: int = 256) -> float:
    """GB/s of one thread summing a tensor far larger than the caches (the floor a decode step reads at)."""
    import torch

    values = torch.ones(size_mib * 2**20 // 4)
    values.sum()
    started = time.perf_counter()
    for _ in range(3):
        values.sum()
    return 3 * values.numel() * 4 / (time.perf_counter() - started) / 1e9


def load(threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpupoor.model.pretrained import dequantized_copy, is_verified, real_model_path

    torch.set_num_threads(threads)
    gguf = real_model_path()
    if not is_verified(gguf):
        sys.exit(f"{gguf}: not there; run `make fetch-real` first")
    directory = dequantized_copy(gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory)


def timed(side: str, model, ids, mask, new: int) -> float:
    """Seconds for `new` greedy tokens of every row (no early end: the end-of-sequence token is not stopped at)."""
    import torch

    from gpupoor.model.decoding import decoder_for

    started = time.perf_counter()
    with torch.inference_mode():
        if side == "transformers":
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        else:
            decoder_for(model).generate(ids, mask, new, None, 0)
    return time.perf_counter() - started


def measure(side: str, model, tokenizer, new: int, batch: int) -> dict:
    import torch

    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]] * batch)
    mask = torch.ones_like(ids)
    first = min(timed(side, model, ids, mask, 1) for _ in range(2))
    whole = timed(side, model, ids, mask, new)
    return {"first_token_s": first, "decode_tokens_s": batch * (new - 1) / (whole - first), "prompt": ids.shape[1]}


def weights_per_token(model) -> int:
    """The weights a decode step multiplies by, per row: every linear layer's and the output head's."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def profile_token(model, tokens: int = 64) -> None:
    """Where a decoded token's time goes: the model's linear layers alone (each a matrix-vector product over its
    weights) against the engine's whole token, and torch.profiler's top operators over 16 tokens."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from gpupoor.model.decoding import decoder_for

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.ones(1, m.in_features) for m in linears]
    with torch.inference_mode():
        for m, x in zip(linears, inputs):
            F.linear(x, m.weight)
        started = time.perf_counter()
        for _ in range(20):
            for m, x in zip(linears, inputs):
                F.linear(x, m.weight)
        linear_s = (time.perf_counter() - started) / 20
    decoder = decoder_for(model)
    ids = torch.arange(1, 9)[None]
    mask = torch.ones_like(ids)
    decoder.generate(ids, mask, 8, None, 0)
    whole = time.perf_counter()
    decoder.generate(ids, mask, tokens + 1, None, 0)
    whole = time.perf_counter() - whole
    first = time.perf_counter()
    decoder.generate(ids, mask, 1, None, 0)
    first = time.perf_counter() - first
    weights = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    print(f"linear layers alone: {linear_s * 1e3:.1f} ms a token ({weights / linear_s / 1e9:.1f} GB/s of weights); "
          f"the engine's token: {(whole - first) / tokens * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decoder.generate(ids, mask, 17, None, 0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def llama_cpp(threads: int, new: int) -> dict | None:
    binary, gguf = os.environ.get("LLAMA_BENCH"), os.environ.get("LLAMA_GGUF")
    if not binary or not gguf or not shutil.which(binary):
        return None
    out = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(new), "-t", str(threads), "-o", "json",
                          "--no-repack", "1"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return {"decode_tokens_s": float(rows[0]["avg_ts"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--profile", action="store_true", help="only say where a decoded token's time goes")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    model, tokenizer = load(args.threads)
    if args.profile:
        return profile_token(model)
    steady = Steady(threads=args.threads)
    steady.warm_up()
    sides = ("transformers", "gpupoor")
    single = {side: [] for side in sides}
    batched = {(side, b): [] for side in sides for b in map(int, args.batches.split(","))}
    bandwidths = []
    for _ in range(args.rounds):
        for side in sides:
            run = steady.run(f"{side} single", lambda: measure(side, model, tokenizer, args.new, 1))
            single[side].append(run)
            bandwidths.append(bandwidth_gbs())
        for side, batch in batched:
            batched[(side, batch)].append(steady.run(f"{side} x{batch}",
                                                     lambda: measure(side, model, tokenizer, 32, batch)))
    probes = [value for entry in steady.log for value in (entry["before"], entry["after"])]
    matmul = statistics.median(probes) * 1e9
    per_token = 2 * weights_per_token(model)
    lines = [f"`{shown_command('bench/generation.py', sys.argv[1:])}`: {cpu}, {args.threads} thread(s), torch "
             f"{__import__('torch').__version__}, SmolLM2-135M-Instruct fp32, greedy, a {single['gpupoor'][0]['prompt']}"
             f"-token prompt; matmul {spread(probes, '{:.0f}')} GFLOP/s, memory "
             f"{spread(bandwidths, '{:.1f}')} GB/s (one thread) around the runs. Medians (min-max) of "
             f"{args.rounds} rounds.", "",
             "| engine | first token (s) | decode tokens/s |", "|---|---:|---:|"]
    for side in sides:
        runs = single[side]
        lines.append(f"| {side} | {spread([r['first_token_s'] for r in runs])} | "
                     f"{spread([r['decode_tokens_s'] for r in runs], '{:.1f}')} |")
    anchor = llama_cpp(args.threads, args.new)
    lines.append(f"| llama.cpp (f32) | | {anchor['decode_tokens_s']:.1f} |" if anchor else
                 "| llama.cpp (f32) | | not run here (LLAMA_BENCH and LLAMA_GGUF unset) |")
    lines += ["", "| engine | rows | decode tokens/s | of the matmul rate |", "|---|---:|---:|---:|"]
    for (side, batch), runs in batched.items():
        rate = statistics.median(r["decode_tokens_s"] for r in runs)
        lines.append(f"| {side} | {batch} | {spread([r['decode_tokens_s'] for r in runs], '{:.0f}')} | "
                     f"{rate * per_token / matmul:.0%} |")
    body = "\n".join(lines + ["", steady.summary(), *steady.notes()])
    print(body)
    if args.write:
        write_section(Path(args.doc), f"generation-t{args.threads}", body)


if __name__ == "__main__":
    main()
