"""The shipped recipes that train the real model (SmolLM2-135M-Instruct's GGUF): they validate and plan as
shipped, pointed at the file `make fetch-real` put in the cache, without loading its weights."""

from __future__ import annotations

import json

import pytest

from support.cli import invoke
from support.recipes import shipped_recipes


def test_the_real_demo_recipe_is_among_those_tested():
    """The parametrized test below runs over what `shipped_recipes` finds: an empty list would run nothing."""
    assert "smollm2-iso-dates.yaml" in [path.name for path in shipped_recipes(real=True)]


@pytest.mark.parametrize("path", shipped_recipes(real=True), ids=lambda path: path.name)
def test_a_real_model_recipe_validates_and_plans(path, real_gguf):
    model = ["--set", f"model.name_or_path={real_gguf}"]
    validated = invoke("validate", path, *model)
    assert validated.exit_code == 0, validated.output
    planned = invoke("plan", path, *model, "--device", "cpu", "--memory", "24GiB", "--json")
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.output)
    assert plan["fits"] is True and plan["peak_bytes"] == sum(term["bytes"] for term in plan["terms"].values())
