"""Recipe schema, YAML loading, --set overrides and errors: one test per validation rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupoor.errors import UserError
from gpupoor.recipe.schema import Recipe, apply_overrides, load_recipe
from gpupoor.units import parse_duration

ROOT = Path(__file__).resolve().parents[2]

MINIMAL = "model:\n  name_or_path: some/model\ndata:\n  path: train.jsonl\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def test_minimal_recipe_gets_documented_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL)).recipe
    assert recipe.precision == "auto" and recipe.peft.rank == 16 and recipe.peft.effective_alpha == 32
    assert recipe.data.format == "text" and recipe.training.micro_batch_size == 1 and recipe.seed == 42


def test_unknown_key_names_line_and_suggests(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "training:\n  learning_rat: 0.1\n"))
    assert "r.yaml:6" in message
    assert "unknown key 'training.learning_rat'" in message
    assert "did you mean 'training.learning_rate'" in message


def test_unknown_top_level_section(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "optimiser: adamw\n"))
    assert "unknown key 'optimiser'" in message and "allowed here:" in message and "training" in message


def test_wrong_type_names_key_value_and_line(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "training:\n  micro_batch_size: many\n"))
    assert "r.yaml:6" in message and "'training.micro_batch_size' = 'many'" in message and "integer" in message


def test_value_out_of_range(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "peft:\n  rank: 0\n"))
    assert "'peft.rank' = 0" in message and "greater than or equal to 1" in message


def test_choice_lists_allowed_values(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "precision: fp8\n"))
    assert "'precision' = 'fp8'" in message and "'bf16'" in message and "'fp32'" in message


def test_missing_required_key(tmp_path):
    message = error_of(write(tmp_path, "model:\n  name_or_path: x/y\n"))
    assert "'data' is required" in message


def test_duplicate_key_is_an_error(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "seed: 1\nseed: 2\n"))
    assert "duplicate key 'seed'" in message and "r.yaml:6" in message


def test_invalid_yaml_names_line(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "training: [unclosed\n"))
    assert "not valid YAML" in message and "r.yaml:" in message


def test_recipe_must_be_a_mapping(tmp_path):
    assert "mapping of sections" in error_of(write(tmp_path, "- a\n- b\n"))


def test_missing_recipe_file(tmp_path):
    assert "recipe not found" in error_of(tmp_path / "nope.yaml")


def test_set_overrides_parse_yaml_scalars(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["training.max_steps=7", "training.learning_rate=1e-3",
                                                    "memory.gradient_checkpointing=true", "peft.target_modules=[q_proj]"]).recipe
    assert recipe.training.max_steps == 7 and recipe.training.learning_rate == 1e-3
    assert recipe.memory.gradient_checkpointing is True and recipe.peft.target_modules == ["q_proj"]


def test_set_error_points_at_the_override(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ["training.max_steps=-1"])
    assert "--set training.max_steps" in message


def test_set_without_equals_is_refused():
    with pytest.raises(UserError, match="KEY.PATH=VALUE"):
        apply_overrides({}, ["training.max_steps"])


def test_set_into_a_scalar_is_refused():
    with pytest.raises(UserError, match="'seed' is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_time_limit_parses_and_rejects_garbage(tmp_path):
    assert parse_duration("11h30m") == 41400 and parse_duration("45m") == 2700 and parse_duration("90") == 90
    recipe = load_recipe(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: 1h2m3s\n")).recipe
    assert recipe.checkpoint.time_limit_s == 3723
    message = error_of(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: soon\n"))
    assert "'checkpoint.time_limit' = 'soon'" in message and "11h30m" in message


def test_time_limit_as_a_bare_number_is_seconds(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: 3600\n")).recipe
    assert recipe.checkpoint.time_limit_s == 3600
    assert "positive duration" in error_of(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: 0\n"))


def test_one_eval_source_only(tmp_path):
    message = error_of(write(tmp_path, MINIMAL.replace("train.jsonl", "train.jsonl\n  eval_rows: 5\n  eval_path: e.jsonl")))
    assert "choose one evaluation source" in message


def test_every_shipped_recipe_validates_against_the_schema():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 3
    for path in recipes:
        load_recipe(path)


def test_recipe_reference_doc_is_generated_from_the_schema():
    from gpupoor.commands.docs import render_recipe_reference

    assert (ROOT / "docs" / "recipe.md").read_text() == render_recipe_reference(), \
        "docs/recipe.md is stale: run `python -m gpupoor.commands.docs`"


def test_json_schema_lists_every_section():
    schema = Recipe.model_json_schema()
    for section in ("model", "data", "peft", "quantization", "precision", "training", "memory", "checkpoint",
                    "logging", "seed", "output_dir"):
        assert section in schema["properties"]


def test_set_of_a_whole_section_is_named_in_errors(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ["training={micro_batch_size: 0}"])
    assert "--set training" in message and "'training.micro_batch_size' = 0" in message
