"""Writes grpo-train.jsonl (300 rows) and grpo-eval.jsonl (50 held-out rows), the real GRPO demo's prompts
(recipes/smollm2-grpo.yaml, docs/grpo.md): make_iso_dates.py's task, each row a chat holding one worked example
first (another sentence and its ISO date), then the question; the last assistant turn is the expected answer the
rewards compare with (it is never trained on). Deterministic (seed 46): the same files byte for byte.

    python recipes/data/make_grpo_dates.py            # rewrites the two files beside this script

Why the worked example: GRPO learns only from groups whose answers score differently. Asked bare, SmolLM2-135M-
Instruct never writes an ISO date; with one example turn it writes the right one in about 1 of 5 answers sampled
at temperature 1 (54% greedy), so most groups hold better and worse answers."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED, TRAIN, EVAL = 46, 300, 50


def _iso_dates():
    spec = importlib.util.spec_from_file_location("make_iso_dates", HERE / "make_iso_dates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows() -> list[dict]:
    iso, rng = _iso_dates(), random.Random(SEED)
    seen, made = set(), []
    while len(made) < TRAIN + EVAL:
        question, answer = (m["content"] for m in iso.make_row(rng)["messages"])
        shot_q, shot_a = (m["content"] for m in iso.make_row(rng)["messages"])
        if question in seen or shot_a == answer:  # each question once; the example never gives the answer away
            continue
        seen.add(question)
        made.append({"messages": [{"role": "user", "content": shot_q}, {"role": "assistant", "content": shot_a},
                                  {"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return made


def main() -> None:
    made = rows()
    for name, part in (("grpo-train.jsonl", made[:TRAIN]), ("grpo-eval.jsonl", made[TRAIN:])):
        (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in part))


if __name__ == "__main__":
    main()
