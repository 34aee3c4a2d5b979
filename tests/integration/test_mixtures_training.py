"""The integration tier of test_mixtures.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from conftest import alpaca_rows, invoke, read_metrics, write_jsonl
from gpupoor.data.mixture import Mixture, Source, source_counts

from test_mixtures import mixture_recipe, two_sources


def test_a_three_to_one_mixture_draws_three_to_one_and_resumes_exactly(make_recipe, two_sources, tmp_path,
                                                                      monkeypatch):
    # 80 examples per epoch (both sources' size), 60 from main and 20 from extra; 4 examples a step.
    recipe = mixture_recipe(make_recipe, two_sources, training={"max_steps": 25, "micro_batch_size": 4})
    straight = invoke("train", recipe, "--output-dir", tmp_path / "straight", monkeypatch=monkeypatch)
    assert straight.exit_code == 0, straight.output
    assert "source main: 40 rows" in straight.output and "60 examples per epoch" in straight.output
    assert "source extra: 40 rows" in straight.output and "20 examples per epoch" in straight.output
    steps = [r for r in read_metrics(tmp_path / "straight") if "loss" in r]
    by_epoch_end = steps[19]["examples_by_source"]  # 20 steps x 4 = one epoch of 80
    assert by_epoch_end == {"main": 60, "extra": 20}
    # Within an epoch the share follows 3:1 up to sampling error (a hypergeometric draw: sd ~ 3 at 40 examples).
    halfway = steps[9]["examples_by_source"]
    assert abs(halfway["main"] - 30) <= 10 and sum(halfway.values()) == 40
    # Stopped in the middle of the first epoch and resumed: the same examples, the same weights.
    stopped = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch, fault="sigterm@7")
    assert stopped.exit_code == 75, stopped.output
    resumed = invoke("resume", tmp_path / "run", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    again = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [(r["loss"], r["examples_by_source"]) for r in again] == [(r["loss"], r["examples_by_source"]) for r in steps]
    a = load_file(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


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
