"""The demo's task and model: reverse four letters; a tiny seeded Llama with a BPE tokenizer trained on the
task's rows. Used by the demo and by the built-in model `gpupoor:demo`; its preference pairs (the reversal chosen,
a wrong one rejected) by recipes/dpo.yaml and recipes/orpo.yaml."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from gpupoor.data.row_formats import alpaca_prompt

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
    `target` (gpupoor.model.builtin commits it atomically as `gpupoor:demo`)."""
    from gpupoor.model.tiny import build_tiny_llama, train_tokenizer

    texts = [alpaca_prompt(r["instruction"], r["input"]) + r["output"] for r in train_rows]
    tokenizer = train_tokenizer(texts, vocab_size=1000)
    build_tiny_llama(target, tokenizer, hidden=MODEL_DIMS["hidden"], layers=MODEL_DIMS["layers"],
                     heads=MODEL_DIMS["heads"], kv_heads=MODEL_DIMS["kv_heads"], seed=0)
    return target


def wrong_reversal(letters: tuple[str, ...], rng: random.Random) -> tuple[str, ...]:
    """A plausible wrong answer: the letters as given, the reversal with two neighbours swapped, or the reversal
    with one letter replaced; never the reversal itself."""
    right = tuple(reversed(letters))
    while True:
        kind, place = rng.randrange(3), rng.randrange(len(letters) - 1)
        wrong = list(letters if kind == 0 else right)
        if kind == 1:
            wrong[place], wrong[place + 1] = wrong[place + 1], wrong[place]
        elif kind == 2:
            wrong[place] = rng.choice([c for c in LETTERS if c != wrong[place]])
        if tuple(wrong) != right:
            return tuple(wrong)


def preference_split(train: int, evaluation: int, seed: int = 0, length: int = 4,
                     prompt=lambda letters: alpaca_prompt(INSTRUCTION, letters)) -> tuple[list[dict], list[dict]]:
    """Preference rows of the same task: the prompt (the demo's alpaca prompt, or `prompt(letters)`), the correct
    reversal chosen, a wrong one rejected. Held out as reverse_split holds out (the same evaluation inputs, none of
    them among the training rows)."""
    sequences = list(itertools.product(LETTERS, repeat=length))
    random.Random(seed).shuffle(sequences)
    rng = random.Random(seed + 1)
    rows = [{"prompt": prompt(" ".join(s)), "chosen": " ".join(reversed(s)), "rejected": " ".join(wrong_reversal(s, rng))}
            for s in sequences]
    return rows[evaluation:evaluation + train], rows[:evaluation]
