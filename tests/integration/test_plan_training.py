"""The integration tier of test_plan.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from gpupoor.cli import app
from gpupoor.plan.make import make_plan
from gpupoor.recipe.loading import load_recipe

from support.runs import read_metrics

from support.plan import runner, small_gpu


def test_preflight_stops_train_and_validate_before_loading_on_a_gpu_that_is_too_small(small_gpu, make_recipe, tmp_path):
    recipe = make_recipe()
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(recipe), "--output-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert "does not fit" in result.output and "--force" in result.output and "what to change" in result.output
    assert not run_dir.exists()
    result = runner.invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 2 and "does not fit" in result.output
    assert runner.invoke(app, ["validate", str(recipe), "--force"]).exit_code == 0


def test_force_trains_anyway_and_metrics_keep_predicted_and_measured_peaks(small_gpu, make_recipe, tmp_path):
    # training.device auto still resolves to this machine's CPU: --force lets it start.
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(make_recipe()), "--output-dir", str(run_dir), "--force"])
    assert result.exit_code == 0, result.output
    assert "does not fit" in result.output and "--force" in result.output
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    # the preflight planned for the (pretend) GPU; the run found the CPU and planned again for it
    cpu_plan = make_plan(load_recipe(run_dir / "recipe.yaml"), "cpu")
    assert steps and all(r["predicted_peak_mb"] == round(cpu_plan.comparable_peak / 2**20, 1) for r in steps)
    assert "MiB planned" in result.output and "process RSS" in result.output


def test_cpu_run_reports_planned_vs_measured_peak(make_recipe, tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(make_recipe()), "--output-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "memory plan: peak" in result.output and "MiB planned" in result.output
    planned = make_plan(load_recipe(run_dir / "recipe.yaml"), "cpu")
    for record in (r for r in read_metrics(run_dir) if "loss" in r):
        assert record["predicted_peak_mb"] == round(planned.comparable_peak / 2**20, 1)
