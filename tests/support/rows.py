"""Rows of data for tests: alpaca rows of varied lengths from a small vocabulary, written as JSONL."""

from __future__ import annotations

import json
import random
from pathlib import Path


WORDS = ("the model learns to stop when the answer is done and every token counts toward the loss "
         "python lists sort reverse add numbers quickly small large data memory speed resume").split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def alpaca_rows(count: int, seed: int = 0) -> list[dict]:
    """Variable-length rows: prompts and answers of different sizes, some with an input."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        row = {"instruction": sentence(rng, 2, 12), "output": sentence(rng, 1, 20)}
        if index % 3 == 0:
            row["input"] = sentence(rng, 1, 8)
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
