"""What a user sees in their terminal is gpupoor's, not its libraries' internals: a profiled run prints no
kineto `USDT:` lines (they are written to the process's stderr below Python, so only a real process shows them)."""

from __future__ import annotations

from support.cli import run_cli


def test_a_profiled_run_prints_no_profiler_internals(make_recipe, tmp_path):
    recipe = make_recipe(training={"max_steps": 6})
    result = run_cli(["train", str(recipe), "--output-dir", str(tmp_path / "run"), "--profile", "2"])
    assert result.returncode == 0, result.stderr
    assert "profile of 2 steps" in result.stdout + result.stderr
    assert "USDT" not in result.stdout + result.stderr
