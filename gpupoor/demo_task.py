"""The demo's task and model: reverse four letters; a tiny seeded Llama with a BPE tokenizer trained on the
task's rows. Used by the demo and by the built-in model `gpupoor:demo`."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from gpupoor.data.formats import alpaca_prompt

LETTERS = "abcdefgh"
INSTRUCTION = "Reverse the letters."
MODEL_DIMS = {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2}


def reverse_split(train: int, evaluation: int, seed: int = 0, length: int = 4) -> tuple[list[dict], list[dict]]:
    """Alpaca rows: `input` is `length` letters, `output` the same letters reversed. No evaluation input
    appears in the training rows, so accuracy measures the learned rule, not memory."""
    sequences = list(itertools.product(LETTERS, repeat=length))
    random.Random(seed).shuffle(sequences)
    rows = [{"instruction": INSTRUCTION, "input": " ".join(s), "output": " ".join(reversed(s))} for s in sequences]
    return rows[evaluation:evaluation + train], rows[:evaluation]


def build_demo_model(target: Path, train_rows: list[dict]) -> Path:
    """A byte-level BPE tokenizer trained on the demo data and a random-weight Llama, both seeded, saved into
    `target` (gpupoor.builtin_models commits it atomically as `gpupoor:demo`)."""
    from gpupoor.tiny import build_tiny_llama, train_tokenizer

    texts = [alpaca_prompt(r["instruction"], r["input"]) + r["output"] for r in train_rows]
    tokenizer = train_tokenizer(texts, vocab_size=1000)
    build_tiny_llama(target, tokenizer, hidden=MODEL_DIMS["hidden"], layers=MODEL_DIMS["layers"],
                     heads=MODEL_DIMS["heads"], kv_heads=MODEL_DIMS["kv_heads"], seed=0)
    return target
