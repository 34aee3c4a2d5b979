"""gpupoor vs the peers (TRL SFTTrainer + peft, LLaMA-Factory + peft) on the real model: SmolLM2-135M-Instruct, one
epoch of the real demo's task, side by side.

The fixture benchmark (bench/compare_trl.py) trains a random 4-layer model whose head and loss dominate; this one
trains a real pretrained model (30 layers, width 576, GQA 9/3, tied embeddings, vocab 49,152) whose decoder layers
dominate. The model is the real tier's: `make fetch-real` verifies the GGUF, and `dequantized_copy` writes it once as
an fp32 transformers directory, which both sides load (the peer reads directories only; loading the same files keeps
the whole-process times comparable). The data is the demo's 340 training rows (recipes/data/iso-dates-train.jsonl),
each as the same prompt/completion text on both sides: prompt = the user's message, completion = the reply.
Settings as the fixture benchmark's: micro batch 8, max_length 512, packed, LoRA r16 on all linear layers, fp32.

Sides, rounds, the matmul probe around every run and the tables are compare_trl.py's. The LLaMA-Factory sides
(lf-packed, lf-neat, each also -gc) run it from its own venv (--lf-python; `make bench-lf-venv` builds
../lf-venv): its settings, its two packings (lf-packed lets examples attend across a row, lf-neat does not and
trains gpupoor's loss) and its template are in bench/peer_llamafactory.py's docstring.

--threads N gives every side N threads: OMP_NUM_THREADS and MKL_NUM_THREADS for every process, and gpupoor also
`--set training.cpu_threads=N`; the matmul probe runs at N threads too, the table says N, and the section's key
ends in -tN (so the 1- and 2-thread tables sit side by side in docs/benchmarks.md). Without it every side uses
its own default (all the cores it may use).

    python bench/compare_trl_real.py [--rounds 3] [--sides ...] [--threads N] [--rows N] [--kit ../shared/bench]
    python bench/compare_trl_real.py --threads 1 --rows 64 \
        --sides gpupoor-packed,gpupoor-packed-gc,lf-packed,lf-packed-gc     # issue #28's table, at 1 thread

`make bench-real` runs it (3 rounds, ~45 minutes on a 2-core machine of ~130 matmul GFLOP/s; TRL's epoch is half).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_llamafactory  # noqa: E402
from compare_trl import (DEFAULT_SIDES, LF_PYTHON_HELP, SETTINGS, SIDES_HELP, Side, check_prerequisites,  # noqa: E402
                         med, peer_names, result_sections, run_rounds)
from machine import ROOT, Steady, gflops, shown_command, usable_cores, write_section  # noqa: E402

DEMO_ROWS = ROOT / "recipes" / "data" / "iso-dates-train.jsonl"
# What a reader of an LF row must know (bench/peer_llamafactory.py's docstring says it all).
LF_NOTE = ("LLaMA-Factory: `packing: true`; \"packed\" is its default packing (a packed row is one causal sequence, "
           "examples attend to earlier ones in the row at restarted positions, so its loss is not the per-example "
           "one), \"neat-packed\" its `neat_packing` (block-diagonal: examples never attend across, as in gpupoor's "
           "packed rows, the same loss); `template: empty` over "
           "the same prompt text and the completion + EOS, `cutoff_len` 512, `lora_target: all`, fp32; its loss is "
           "`train_loss`, its training s `train_runtime`, its tokens counted from the rows as it encodes them. ")


def build_real_fixture(rows: int | None = None) -> Path:
    """build/bench/real-smollm2/: `model` (a link to the verified dequantized copy), data.jsonl as the kit's alpaca
    rows for the peer, and prompt-completion.jsonl, the same text for gpupoor."""
    from gpupoor.model.pretrained import dequantized_copy, fetch_real, is_verified, real_model_path

    gguf = real_model_path()
    if not is_verified(gguf):
        print(f"fetching the real model into {gguf} (make fetch-real) ...", flush=True)
        fetch_real(target=gguf)
    model = dequantized_copy(gguf)
    fixture = ROOT / "build" / "bench" / "real-smollm2"
    fixture.mkdir(parents=True, exist_ok=True)
    link = fixture / "model"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(model, target_is_directory=True)
    pairs = []
    for line in DEMO_ROWS.read_text().splitlines()[:rows]:
        user, assistant = (m["content"] for m in json.loads(line)["messages"])
        pairs.append((user, assistant))
    # The peer builds its prompt as instruction + "\n" + input + "\n": gpupoor gets that very text.
    (fixture / "data.jsonl").write_text("".join(
        json.dumps({"instruction": user, "input": "", "output": reply}) + "\n" for user, reply in pairs))
    (fixture / "prompt-completion.jsonl").write_text("".join(
        json.dumps({"prompt": user + "\n\n", "completion": reply}) + "\n" for user, reply in pairs))
    (fixture / "fixture.json").write_text(json.dumps({"rows": len(pairs)}) + "\n")
    return fixture


def cpu_model() -> str:
    """The CPU's model name and its bf16 matrix units (the figures depend on both), from /proc/cpuinfo."""
    from gpupoor.cpu import bf16_units, cpu_flags

    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name}, bf16 units: {bf16_units(cpu_flags(info)) or 'none'}"


def render(rounds: int, results: dict, sides: dict, rows: int, steady: Steady, command: str,
           versions: dict[str, str], threads: int | None, model_dir: Path) -> str:
    threads_said = (f"{threads} thread{'s' if threads > 1 else ''} per side" if threads
                    else "each side's default threads")
    precisions = sorted({side.precision for side in sides.values()})
    said = ", ".join(precisions) if precisions != ["fp32"] else "fp32"
    cpu = cpu_model()
    lines = [f"### Real model: SmolLM2-135M-Instruct, gpupoor vs {peer_names(sides, versions)} (CPU, {said}, "
             f"{threads_said})", "",
             f"`{command}` on {usable_cores()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}, "
             f"{threads_said}" + (" (OMP_NUM_THREADS, MKL_NUM_THREADS, gpupoor's training.cpu_threads)"
                                  if threads else "") + ". "
             "SmolLM2-135M-Instruct (llama, 30 layers, width 576, GQA 9/3, tied embeddings, vocab 49,152) from "
             "`make fetch-real`'s GGUF, dequantized once to an fp32 directory that every side loads; one epoch of "
             f"the real demo's {rows} training rows as prompt/completion text (the same text on every side); "
             f"micro batch {SETTINGS['batch']}, max_length {SETTINGS['seq']}, packed, LoRA r{SETTINGS['rank']} on "
             f"all linear layers, {said} (the row says which: auto is bf16 on a CPU with bf16 matrix units); CPU "
             f"{cpu}; gradient checkpointing only where the row says so. Median (min-max) of "
             f"{rounds} alternating rounds; columns as in the fixture tables above. "
             + (LF_NOTE if any(side.tool == "lf" for side in sides.values()) else "") + steady.summary(), ""]
    return "\n".join(lines + result_sections(results, sides, steady)
                     + matmul_peak_lines(results, sides, threads, model_dir)) + "\n"


def matmul_flops_per_token(model_dir: Path, checkpointing: bool) -> float:
    """The matmul work of a LoRA step per token on a frozen base: forward 2 x the linear and head parameters, the
    backward's input gradients as much again (frozen weights need no weight gradient), and with checkpointing a
    second forward. (Attention's own products and LoRA's rank-16 ones are left out: a few % here.)"""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    linear = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv + 3 * hidden * inter)
    params = linear + config["vocab_size"] * hidden
    return 2 * params * (3 if checkpointing else 2)


def matmul_peak_lines(results: dict, sides: dict, threads: int | None, model_dir: Path) -> list[str]:
    """How much of this CPU's matmul rate each side reaches: its tokens/s times the step's matmul work per token,
    over a 2048^2 matmul's GFLOP/s in the dtype the side multiplies in (bf16 for gpupoor's bf16 or auto on a CPU
    with units and LF's bf16: true; fp32 otherwise)."""
    from gpupoor.cpu import this_cpus_bf16_units

    peaks = {dtype: gflops(threads, dtype) for dtype in ("float32", "bfloat16")}
    lines = ["", f"Matmul rate reached (2048^2 matmul probe: fp32 {peaks['float32']:.0f} GFLOP/s, bf16 "
             f"{peaks['bfloat16']:.0f} GFLOP/s; work per token: forward and input-gradient matmuls of every linear "
             "layer and the head, a second forward with checkpointing):", "",
             "| run | matmul GFLOP/s reached | of the peak in its dtype |", "|---|---:|---:|"]
    units = bool(this_cpus_bf16_units())
    for label, side in sides.items():
        bf16 = side.precision == "bf16" or (side.precision == "auto" and units)
        dtype = "bfloat16" if bf16 else "float32"
        reached = med(results[label], "tokens_per_s") * matmul_flops_per_token(model_dir, side.checkpointing) / 1e9
        lines.append(f"| {label} | {reached:.0f} | {reached / peaks[dtype]:.0%} of {dtype} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attempts", type=int, default=3,
                        help="tries per run when the probe says the machine was busy (1: never repeat, flag it)")
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--sides", default=DEFAULT_SIDES, help=SIDES_HELP)
    parser.add_argument("--lf-python", default=peer_llamafactory.default_python(), help=LF_PYTHON_HELP)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every side (OMP/MKL_NUM_THREADS; gpupoor's training.cpu_threads)")
    parser.add_argument("--rows", type=int, default=None, help="only the first N demo rows (a quick check)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to write into")
    args = parser.parse_args()
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: give 1 or more")
    kit = Path(args.kit)
    parsed = [Side.parse(name) for name in args.sides.split(",") if name]
    versions = check_prerequisites(kit, parsed, args.lf_python)
    os.environ[peer_llamafactory.PYTHON_ENV] = args.lf_python  # where the LF side's runs find it
    extra = []
    if args.threads:  # inherited by every process the sides start (and by the probe's, which also sets it)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
        extra = [f"training.cpu_threads={args.threads}"]
    sides = {side.label([], versions): side for side in parsed}
    fixture = build_real_fixture(args.rows)
    steady = Steady(threads=args.threads, attempts=args.attempts)
    print(f"matmul reference before the first run: {steady.warm_up():.0f} GFLOP/s", flush=True)
    results = run_rounds(sides, args.rounds, kit, fixture, extra, steady)
    command = shown_command("bench/compare_trl_real.py", sys.argv[1:])
    rows = json.loads((fixture / "fixture.json").read_text())["rows"]
    body = render(args.rounds, results, sides, rows, steady, command, versions, args.threads, fixture / "model")
    half = "-bf16" if any(side.precision != "fp32" for side in parsed) else ""  # its own section: fp32's stays
    key = ("trl-real-smollm2" + half + (f"-t{args.threads}" if args.threads else "")
           + ("" if args.rows is None else "-partial"))
    write_section(Path(args.doc), key, body)
    print(body)


if __name__ == "__main__":
    main()
