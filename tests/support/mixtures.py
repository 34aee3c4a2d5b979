"""Shared by the mixtures tests (moved from unit/data/test_mixtures.py, whose tests still use them)."""

from __future__ import annotations

import pytest

from support.rows import alpaca_rows, write_jsonl


@pytest.fixture()
def two_sources(tmp_path):
    return (write_jsonl(tmp_path / "main.jsonl", alpaca_rows(40, seed=0)),
            write_jsonl(tmp_path / "extra.jsonl", alpaca_rows(40, seed=5)))


def mixture_recipe(make_recipe, two_sources, **overrides):
    main, extra = two_sources
    sources = [{"path": str(main), "weight": 3}, {"path": str(extra), "name": "extra", "weight": 1}]
    data = {"path": None, "datasets": sources, **overrides.pop("data", {})}
    return make_recipe(data=data, **overrides)
