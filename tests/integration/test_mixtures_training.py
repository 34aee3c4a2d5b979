"""The integration tier of test_mixtures.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl
from support.runs import read_metrics

from support.mixtures import two_sources


def test_eval_is_reported_per_source_and_overall(make_recipe, two_sources, tmp_path):
    main, extra = two_sources
    recipe = make_recipe(data={"path": None, "datasets": [{"path": str(main), "eval_rows": 6},
                                                           {"path": str(extra), "eval_rows": 4, "epochs": 0.5}]},
                         training={"max_steps": 2, "eval_every_steps": 1})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    # The start-up summary counts training rows only; the held-out ones are eval's (#25).
    assert "data 70 examples (70 rows;" in result.output and "; eval 10 examples" in result.output
    assert "source main: 34 rows, 34 examples," in result.output and "; eval 6" in result.output
    assert "source extra: 36 rows, 36 examples," in result.output and "18 examples per epoch; eval 4" in result.output
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]
    for record in evals:
        by_source = record["eval_loss_by_source"]
        assert set(by_source) == {"main", "extra"}
        low, high = sorted(by_source.values())
        assert low <= record["eval_loss"] <= high  # the overall loss weighs both sources by their targets


@pytest.mark.parametrize("datasets, key", [
    ([{"path": "missing.jsonl"}], "data.datasets[0].path"),
    ([{"path": "train.jsonl", "weight": 0}], "data.datasets.0.weight"),
    ([{"path": "train.jsonl", "weight": 2}, {"path": "train.jsonl"}], "every source a weight"),
    ([{"path": "train.jsonl", "weight": 2, "rows": 5}], "weight and rows"),
])
def test_bad_sources_are_exit_2_naming_the_source(make_recipe, tmp_path, datasets, key):
    write_jsonl(tmp_path / "train.jsonl", alpaca_rows(8))
    result = invoke("train", make_recipe(data={"path": None, "datasets": datasets}), "--output-dir",
                    tmp_path / "run")
    assert result.exit_code == 2 and key in result.output, result.output
