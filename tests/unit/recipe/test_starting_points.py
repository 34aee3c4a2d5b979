"""Starting points: a recipe that `extends` another, a run that starts from an adapter (`peft.init_adapter`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from gpupoor.errors import UserError
from gpupoor.recipe.loading import load_recipe

from support.cli import invoke
from support.runs import read_metrics
from support.starting_points import foreign_adapter

BASE = """\
model:
  name_or_path: some/model
data:
  path: train.jsonl
  format: alpaca
training:
  learning_rate: 0.001
  max_steps: 10
peft:
  rank: 8
  target_modules: [q_proj, k_proj, v_proj]
"""


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_recipe(path, overrides)
    return str(info.value)


# ------------------------------------------------------------------------------------------------- extends


def test_child_keys_merge_over_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\ntraining:\n  max_steps: 3\npeft:\n  target_modules: [q_proj]\n"
                     "data:\n  eval_rows: 4\n")
    recipe = load_recipe(child).recipe
    assert recipe.training.max_steps == 3 and recipe.training.learning_rate == 0.001  # mappings merge by key
    assert recipe.peft.target_modules == ["q_proj"] and recipe.peft.rank == 8  # a list is replaced, not appended
    assert recipe.data.path == "train.jsonl" and recipe.data.format == "alpaca" and recipe.data.eval_rows == 4


def test_a_child_can_unset_what_the_base_set_and_bases_chain(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE + "quantization:\n  bits: 4\n")
    (tmp_path / "mid.yaml").write_text("extends: base.yaml\nseed: 5\ntraining:\n  max_steps: 2\n")
    nested = tmp_path / "stage2"
    nested.mkdir()
    child = nested / "child.yaml"
    child.write_text("extends: ../mid.yaml\nquantization:\n  bits: null\n")
    recipe = load_recipe(child).recipe
    assert recipe.quantization.bits is None and recipe.seed == 5 and recipe.training.max_steps == 2


def test_set_overrides_apply_over_base_and_child(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\ntraining:\n  max_steps: 3\n")
    loaded = load_recipe(child, ["training.max_steps=7", "training.learning_rate=0.5"])
    assert loaded.recipe.training.max_steps == 7 and loaded.recipe.training.learning_rate == 0.5
    assert loaded.overridden == ("training.max_steps", "training.learning_rate")
    assert "--set training.max_steps" in error_of(child, ["training.max_steps=-1"])


def test_an_error_names_the_file_and_line_that_wrote_the_key(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE + "precision: fp8\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\n\ntraining:\n  micro_batch_size: many\n")
    message = error_of(child)
    assert f"{tmp_path / 'base.yaml'}:12: 'precision' = 'fp8'" in message  # in the base, on its line
    assert f"{child}:4: 'training.micro_batch_size' = 'many'" in message  # in the child, on its own line
    (tmp_path / "base.yaml").write_text(BASE + "training_:\n  x: 1\n")
    child.write_text("extends: base.yaml\n")
    assert f"{tmp_path / 'base.yaml'}:12: unknown key 'training_'" in error_of(child)


def test_a_key_the_child_overrides_points_at_the_child(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\ntraining:\n  learning_rate: -1\n")
    assert f"{child}:3: 'training.learning_rate' = -1" in error_of(child)


def test_yaml_errors_in_the_base_name_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE + "seed: 1\nseed: 2\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\n")
    message = error_of(child)
    assert "duplicate key 'seed'" in message and f"{tmp_path / 'base.yaml'}:13" in message


def test_a_cycle_names_the_files(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("extends: b.yaml\n" + BASE)
    b.write_text("seed: 1\nextends: a.yaml\n")
    message = error_of(a)
    assert f"{b}:2: extends: a.yaml makes a cycle: {a} -> {b} -> {a}" in message
    a.write_text("extends: a.yaml\n")
    assert "makes a cycle" in error_of(a)


def test_a_missing_base_is_exit_2_naming_the_extends_line(tmp_path, monkeypatch):
    child = tmp_path / "child.yaml"
    child.write_text("# stage two\nextends: nothere.yaml\n" + BASE)
    result = invoke("validate", child, monkeypatch=monkeypatch)
    assert result.exit_code == 2, result.output
    assert f"{child}:2: extends: nothere.yaml: no such file ({tmp_path / 'nothere.yaml'})" in result.output
    child.write_text("extends: [a, b]\n" + BASE)
    assert "give the path of a base recipe" in error_of(child)


# -------------------------------------------------------------------------------------------- init_adapter


def test_settings_that_differ_are_found_without_loading_weights(foreign_adapter, make_recipe):
    from gpupoor.model.init_adapter import check_init_adapter

    def problem(**peft) -> str:
        with pytest.raises(UserError) as info:
            check_init_adapter(load_recipe(make_recipe(peft={"target_modules": ["q_proj", "v_proj"], "rank": 4,
                                                             "init_adapter": "foreign", **peft})))
        return str(info.value)

    check_init_adapter(load_recipe(make_recipe(peft={"rank": 4, "target_modules": ["q_proj", "v_proj"],
                                                     "init_adapter": "foreign"})))  # relative to the recipe
    assert "peft.rank: the recipe builds 8, the adapter has 4" in problem(rank=8)
    assert "peft.alpha: the recipe builds 16.0, the adapter has 8" in problem(alpha=16)
    assert "peft.method: the recipe builds dora, the adapter has lora" in problem(method="dora")
    assert "peft.target_modules: the recipe builds [q_proj], the adapter has [q_proj, v_proj]" in problem(
        target_modules=["q_proj"])
    assert "peft.modules_to_save: the recipe builds [lm_head], the adapter has []" in problem(
        modules_to_save=["lm_head"])
    message = problem(method="full")
    assert "peft.method full trains the model's own weights and cannot start from an adapter" in message
    assert "no such directory" in problem(init_adapter="nowhere")
    (foreign_adapter.parent / "adapter.safetensors").write_bytes(b"")
    message = problem(init_adapter="adapter.safetensors")
    assert f"{foreign_adapter.parent / 'adapter.safetensors'} is a file; expected an adapter directory" in message
    assert "no such directory" not in message
    unfinished = foreign_adapter.parent / "unfinished"
    unfinished.mkdir()
    (unfinished / "recipe.yaml").write_text("")  # a run dir that has no final/ yet
    assert "(the run has not finished)" in problem(init_adapter="unfinished")
    whole = foreign_adapter.parent / "whole"
    whole.mkdir()
    (whole / "config.json").write_text("{}")
    assert "holds a whole fine-tuned model (peft.method: full), not an adapter" in problem(init_adapter="whole")
