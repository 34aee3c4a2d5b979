"""The offline demo (`make demo`): teach a tiny random-weight model to reverse letters with LoRA, then show
its answers and its accuracy before and after training. Nothing is downloaded: the data ships in
recipes/data/ and the model (`gpupoor:demo`) is built from a seed into the cache on first use."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accuracy(model, tokenizer, rows: list[dict]) -> tuple[float, list[str]]:
    from gpupoor.data.encoder import Encoder
    from gpupoor.model.generation import complete

    encoder = Encoder(tokenizer, "alpaca", max_length=128)  # the prompts exactly as training tokenized them
    prompts = [encoder.encode_prompt(row, f"eval[{i}]") for i, row in enumerate(rows)]
    answers = complete(model, tokenizer, prompts, max_new_tokens=12)
    correct = sum(answer == row["output"] for answer, row in zip(answers, rows))
    return correct / len(rows), answers


PROMPTS = "recipes/data/prompts.jsonl"  # shipped: three rows of the demo's task, in its alpaca format


def next_commands(run_dir: Path) -> list[tuple[str, str]]:
    """(command line, what it shows) to try on the run the demo just made, as a new user types them."""
    run = str(run_dir)
    return [(f"gpupoor generate {run} --file {PROMPTS}", "the tuned model's answers (greedy)"),
            (f"gpupoor status {run}", "steps, checkpoints, metrics"),
            (f"gpupoor report {run}", f"loss and eval-loss plots in {run}/report.html"),
            (f"gpupoor merge-lora {run} --output merged/{run_dir.name}", "a standalone transformers model"),
            (f"gpupoor export {run} -q q8_0", "a GGUF file for llama.cpp / Ollama, with its quality cost")]


def print_next_commands(run_dir: Path) -> None:
    print("\nnext, on this run (`gpupoor` is .venv/bin/gpupoor: `source .venv/bin/activate` puts it on your PATH):")
    lines = next_commands(run_dir)
    width = max(len(command) for command, _ in lines)
    for command, what in lines:
        print(f"  {command:<{width}}  # {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--output-dir", default=None, help="default: runs/demo-<time>")
    args = parser.parse_args(argv)
    # the demo trains in under a minute: measuring its time plan first (~20 s) would cost more than it tells; a
    # plan already cached is shown (`gpupoor plan recipes/demo.yaml` measures it)
    os.environ.setdefault("GPUPOOR_TIME_PLAN", "cached")

    from gpupoor.quiet import bitsandbytes_unless_loaded, quiet_libraries
    from gpupoor.run.orchestrate import train_from_recipe

    quiet_libraries()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpupoor.recipe.loading import load_recipe

    from gpupoor.model.builtin import resolve_model_path

    loaded = load_recipe(args.recipe)
    recipe = loaded.recipe
    model_dir = resolve_model_path(recipe.model.name_or_path, loaded.base_dir)  # gpupoor:demo: built on first use
    eval_rows = read_jsonl(loaded.base_dir / recipe.data.eval_path)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    before, _ = accuracy(base, tokenizer, eval_rows)
    print(f"accuracy before training: {before:.0%} on {len(eval_rows)} held-out examples\n")

    output_dir = args.output_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    result = train_from_recipe(loaded, output_dir)

    with bitsandbytes_unless_loaded():
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), result.run_dir / "final")
    after, answers = accuracy(tuned, tokenizer, eval_rows)
    print(f"\n{'input':<12} {'expected':<12} {'model says':<12}")
    for row, answer in list(zip(eval_rows, answers))[:6]:
        mark = "ok" if answer == row["output"] else "wrong"
        print(f"{row['input']:<12} {row['output']:<12} {answer:<12} {mark}")
    print(f"\naccuracy before training: {before:.0%}   after: {after:.0%}   "
          f"({len(eval_rows)} held-out examples, greedy decoding)")
    print(f"the adapter is in {result.run_dir / 'final'} (loads with peft.PeftModel.from_pretrained)")
    if after < before + 0.5:
        print("error: the demo did not learn the task as expected", file=sys.stderr)
        return 1
    print_next_commands(_relative(result.run_dir))
    return 0


def _relative(path: Path) -> Path:
    """The run as the user would type it from here (runs/demo-...), or as it is when elsewhere."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


if __name__ == "__main__":
    sys.exit(main())
