"""Shared by the tokenize tests (moved from unit/data/test_tokenize.py, whose tests still use them)."""

from __future__ import annotations


import pytest

from support.rows import alpaca_rows, write_jsonl


@pytest.fixture()
def mixture_recipe(make_recipe, tmp_path):
    write_jsonl(tmp_path / "extra.jsonl", [{"prompt": r["instruction"] + "\n", "completion": r["output"]}
                                           for r in alpaca_rows(20, seed=5)])
    data = {"path": None, "datasets": [{"path": str(tmp_path / "train.jsonl"), "eval_rows": 6, "weight": 2},
                                       {"path": str(tmp_path / "extra.jsonl"), "format": "completion", "weight": 1}]}
    return make_recipe("mixture.yaml", data=data)


def _build_reads_tokenized_dirs() -> bool:
    import inspect

    from gpupoor.data import build

    return "load_tokenized_dir" in inspect.getsource(build)
