"""The integration tier of test_bad_input.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from gpupoor.cli import app
from gpupoor.commands.validate import PREFLIGHT_ROWS

from support.bad_input import SURROGATE_ROWS, runner, surrogate_recipe


@pytest.mark.parametrize("fmt", ["alpaca", "chat"])
def test_lone_surrogate_fails_tokenize_and_train_with_exit_2(make_recipe, tmp_path, fmt):
    recipe = surrogate_recipe(make_recipe, tmp_path, fmt)
    result = runner.invoke(app, ["tokenize", str(recipe), "--output", str(tmp_path / "tokenized")])  # no preflight
    assert result.exit_code == 2, result.output
    assert f"lone.jsonl:2: {SURROGATE_ROWS[fmt][2]}: \\ud800" in result.output
    assert not (tmp_path / "tokenized").exists()
    # Past the rows validate reads (PREFLIGHT_ROWS), training's own reading of the rows refuses it.
    good, bad = SURROGATE_ROWS[fmt][:2]
    data = tmp_path / "lone.jsonl"
    data.write_text((json.dumps(good) + "\n") * PREFLIGHT_ROWS + json.dumps(bad) + "\n")
    result = runner.invoke(app, ["train", str(recipe), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert f"lone.jsonl:{PREFLIGHT_ROWS + 1}: {SURROGATE_ROWS[fmt][2]}: \\ud800" in result.output
