"""gpupoor vs the peer (TRL SFTTrainer + peft) on the real model: SmolLM2-135M-Instruct, one epoch of the real demo's
task, side by side.

The fixture benchmark (bench/compare_trl.py) trains a random 4-layer model whose head and loss dominate; this one
trains a real pretrained model (30 layers, width 576, GQA 9/3, tied embeddings, vocab 49,152) whose decoder layers
dominate. The model is the real tier's: `make fetch-real` verifies the GGUF, and `dequantized_copy` writes it once as
an fp32 transformers directory, which both sides load (the peer reads directories only; loading the same files keeps
the whole-process times comparable). The data is the demo's 340 training rows (recipes/data/iso-dates-train.jsonl),
each as the same prompt/completion text on both sides: prompt = the user's message, completion = the reply.
Settings as the fixture benchmark's: micro batch 8, max_length 512, packed, LoRA r16 on all linear layers, fp32.

Sides, rounds, the matmul probe around every run and the tables are compare_trl.py's.

    python bench/compare_trl_real.py [--rounds 3] [--sides ...] [--kit ../shared/bench]

`make bench-real` runs it (3 rounds, ~45 minutes on a 2-core machine of ~130 matmul GFLOP/s; TRL's epoch is half).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import (DEFAULT_SIDES, SETTINGS, Side, check_prerequisites, result_sections,  # noqa: E402
                         run_rounds)
from machine import ROOT, Steady, shown_command, usable_cores, write_section  # noqa: E402

DEMO_ROWS = ROOT / "recipes" / "data" / "iso-dates-train.jsonl"


def build_real_fixture(rows: int | None = None) -> Path:
    """build/bench/real-smollm2/: `model` (a link to the verified dequantized copy), data.jsonl as the kit's alpaca
    rows for the peer, and prompt-completion.jsonl, the same text for gpupoor."""
    from gpupoor.commands.fetch_real import dequantized_copy, fetch_real, is_verified, real_model_path

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


def render(rounds: int, results: dict, sides: dict, rows: int, steady: Steady, command: str,
           trl_version: str) -> str:
    lines = [f"### Real model: SmolLM2-135M-Instruct, gpupoor vs TRL {trl_version} SFTTrainer + peft (CPU, fp32)", "",
             f"`{command}` on {usable_cores()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}. "
             "SmolLM2-135M-Instruct (llama, 30 layers, width 576, GQA 9/3, tied embeddings, vocab 49,152) from "
             "`make fetch-real`'s GGUF, dequantized once to an fp32 directory that both sides load; one epoch of "
             f"the real demo's {rows} training rows as prompt/completion text (the same text on every side); "
             f"micro batch {SETTINGS['batch']}, max_length {SETTINGS['seq']}, packed, LoRA r{SETTINGS['rank']} on "
             "all linear layers, fp32; gradient checkpointing only where the row says so. Median (min-max) of "
             f"{rounds} alternating rounds; columns as in the fixture tables above. " + steady.summary(), ""]
    return "\n".join(lines + result_sections(results, sides, steady)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--sides", default=DEFAULT_SIDES,
                        help="comma-separated: gpupoor-{packed,length_grouped,random}[-gc], trl-{packed,padded}[-gc]")
    parser.add_argument("--rows", type=int, default=None, help="only the first N demo rows (a quick check)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown file to write into")
    args = parser.parse_args()
    kit = Path(args.kit)
    parsed = [Side.parse(name) for name in args.sides.split(",") if name]
    trl_version = check_prerequisites(kit, parsed)
    sides = {side.label([], trl_version): side for side in parsed}
    fixture = build_real_fixture(args.rows)
    steady = Steady()
    print(f"matmul reference before the first run: {steady.warm_up():.0f} GFLOP/s", flush=True)
    results = run_rounds(sides, args.rounds, kit, fixture, [], steady)
    command = shown_command("bench/compare_trl_real.py", sys.argv[1:])
    rows = json.loads((fixture / "fixture.json").read_text())["rows"]
    body = render(args.rounds, results, sides, rows, steady, command, trl_version)
    write_section(Path(args.doc), "trl-real-smollm2" if args.rows is None else "trl-real-smollm2-partial", body)
    print(body)


if __name__ == "__main__":
    main()
