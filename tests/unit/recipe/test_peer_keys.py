"""Keys from LLaMA-Factory and axolotl recipes: the unknown-key error says where gpupoor has each, every gpupoor key
the table names exists, and docs/migration.md lists them all."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from gpupoor.errors import UserError
from gpupoor.recipe.loading import load_recipe, section_model
from gpupoor.recipe.peer_keys import PEER_KEYS, SECTION_PEER_KEYS
from gpupoor.recipe.schema import Recipe

DOCS = Path(__file__).resolve().parents[3] / "docs" / "migration.md"


def schema_has(dotted: str) -> bool:
    """`data.datasets[].format`: `[]` is any item of a list of sections."""
    model = Recipe
    for part in dotted.split("."):
        name = part.removesuffix("[]")
        if model is None or name not in model.model_fields:
            return False
        annotation = model.model_fields[name].annotation
        if part.endswith("[]"):  # list[Section] | None: the section of an item
            annotation = next(typing.get_args(option)[0] for option in typing.get_args(annotation)
                              if typing.get_origin(option) is list)
        model = section_model(annotation)
    return True


@pytest.mark.parametrize("key", sorted(PEER_KEYS))
def test_every_gpupoor_key_the_table_names_exists(key):
    assert schema_has(PEER_KEYS[key].ours), f"{key} -> {PEER_KEYS[key].ours}"


@pytest.mark.parametrize("section, key", sorted(SECTION_PEER_KEYS))
def test_every_gpupoor_key_the_section_table_names_exists(section, key):
    ours = SECTION_PEER_KEYS[section, key].ours
    assert schema_has(ours) and schema_has(section) and ours.rsplit(".", 1)[0] == section, (section, key, ours)


def test_a_recipe_written_with_their_keys_is_told_ours_at_each_line(tmp_path):
    theirs = {"model": {"name_or_path": "gpupoor:demo"}, "data": {"path": "rows.jsonl"},
              "base_model": "x", "model_name_or_path": "x",
              "lora_r": 8, "lora_rank": 8, "cutoff_len": 512, "sequence_len": 512, "num_train_epochs": 3,
              "per_device_train_batch_size": 4, "gradient_checkpointing": True, "learning_rate": 1e-4}
    path = tmp_path / "theirs.yaml"
    path.write_text(yaml.safe_dump(theirs, sort_keys=False))
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    message = caught.value.message
    lines = path.read_text().splitlines()
    for key in theirs:
        if key in ("model", "data"):
            continue
        line = next(number for number, text in enumerate(lines, 1) if text.startswith(f"{key}:"))
        assert f"{path}:{line}: unknown key '{key}'; " in message
        assert f"'{key}' is gpupoor's '{PEER_KEYS[key].ours}'" in message


def test_a_key_already_where_gpupoor_has_it_is_no_error(tmp_path, make_recipe):
    recipe = load_recipe(make_recipe(training={"learning_rate": 3e-4, "gradient_accumulation_steps": 2,
                                               "max_steps": 3})).recipe
    assert recipe.training.gradient_accumulation_steps == 2


def test_nested_under_the_wrong_section_names_the_right_one(tmp_path, make_recipe):
    path = make_recipe(data={"cutoff_len": 256})
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    assert "unknown key 'data.cutoff_len'; LLaMA-Factory's 'cutoff_len' is gpupoor's 'data.max_length'" in \
        caught.value.message


def test_the_migration_page_lists_every_key():
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    told = {(line.split("|")[1].strip().split("`")[1], line.split("|")[3].strip().strip("`")) for line in rows}
    wanted = [(key, peer.ours) for key, peer in PEER_KEYS.items()]
    wanted += [(key, peer.ours) for (_, key), peer in SECTION_PEER_KEYS.items()]
    missing = [pair for pair in wanted if pair not in told]
    assert not missing, missing


def test_their_names_for_a_datasets_format_and_the_lora_rank_are_told_as_ours(make_recipe):
    """axolotl writes a dataset's format as `type`, PEFT the LoRA rank as `r`: names too common to tell
    anywhere, so they are told where those tools write them, with the entry's own index."""
    path = make_recipe()
    recipe = yaml.safe_load(path.read_text())
    rows = recipe["data"]["path"]
    recipe["data"] = {"datasets": [{"path": rows}, {"path": rows, "type": "alpaca"}], "type": "alpaca"}
    recipe["peft"] = {"r": 8}
    recipe["type"] = "x"  # not where any tool writes it: no hint
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    message = caught.value.message
    lines = path.read_text().splitlines()
    line = next(number for number, text in enumerate(lines, 1) if text.strip() == "type: alpaca")
    assert f"{path}:{line}: unknown key 'data.datasets.1.type'; axolotl's 'type' is gpupoor's " \
           "'data.datasets[1].format': text, alpaca, chat" in message, message
    assert "allowed here: path, name, format," in message
    assert "unknown key 'data.type'; axolotl's 'type' is gpupoor's 'data.format'" in message
    assert "unknown key 'peft.r'; PEFT's 'r' is gpupoor's 'peft.rank'" in message
    assert "unknown key 'type'\n" in message


@pytest.mark.parametrize("key, theirs, ours", [("template", "qwen", "qwen2.5"), ("template", "deepseek3", "deepseek"),
                                               ("chat_template", "qwen_25", "qwen2.5"),
                                               ("chat_template", "phi_35", "phi3")])
def test_their_template_name_is_told_as_ours(make_recipe, key, theirs, ours):
    path = make_recipe()
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), key: theirs}, sort_keys=False))
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    assert f"'{key}' is gpupoor's 'data.chat_template', and its '{theirs}' is gpupoor's '{ours}'" in \
        caught.value.message


def test_every_template_name_we_map_to_is_shipped():
    from gpupoor.data.chat_templates import NAMES
    from gpupoor.recipe.peer_keys import PEER_TEMPLATE_NAMES

    assert {ours for names in PEER_TEMPLATE_NAMES.values() for ours in names.values()} <= set(NAMES)
    assert set(PEER_TEMPLATE_NAMES) <= set(PEER_KEYS)
