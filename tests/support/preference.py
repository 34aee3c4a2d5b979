"""Shared by the preference tests (moved from unit/objectives/test_preference.py, whose tests still use them)."""

from __future__ import annotations

import random

import pytest
import torch

from support.rows import WORDS, write_jsonl
from support.runs import read_metrics


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the runs' recipes use: two threads on two busy cores are many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pair_rows(count: int, seed: int = 0) -> list[dict]:
    """Pairs of different lengths: a prompt, two different answers."""
    rng = random.Random(seed)

    def words(low, high):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = []
    for _ in range(count):
        chosen = words(1, 9)
        rejected = words(1, 9)
        rows.append({"prompt": words(2, 10), "chosen": chosen, "rejected": rejected if rejected != chosen else
                     rejected + " stop"})
    return rows


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-9) -> bool:
    """Equal up to `rel` of b's norm."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm()) <= rel * max(float(b.norm()), 1e-30)


# ------------------------------------------------------------------------------------------- runs end to end
@pytest.fixture()
def pairs_file(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", pair_rows(24))


def dpo_recipe(make_recipe, pairs_file, name: str, **sections):
    """A DPO recipe on the tiny model; keyword sections are merged over these."""
    merged = {"data": {"path": str(pairs_file), "format": "preference", "max_length": 64, "sampler": "random"},
              "training": {"objective": "dpo", "micro_batch_size": 2, "max_steps": 4},
              "preference": {"beta": 0.5}}
    for key, value in sections.items():
        merged[key] = {**merged.get(key, {}), **value}
    return make_recipe(name, **merged)


def steps(run) -> list[dict]:
    return [record for record in read_metrics(run) if "loss" in record]
