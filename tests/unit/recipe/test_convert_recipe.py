"""`gpupoor convert-recipe`: LLaMA-Factory's own example recipes (tests/data/llama-factory, Apache-2.0) and an axolotl
one become gpupoor recipes that validate, with every key not carried over said at the top."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from support.cli import invoke
from support.rows import alpaca_rows

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "llama-factory"
SFT = ("llama3_lora_sft.yaml", "llama3_lora_sft_otfq.yaml", "llama3_full_sft.yaml")


@pytest.fixture()
def lf_dir(tmp_path) -> Path:
    """A folder as LLaMA-Factory's own: the example recipes, and data/ with a dataset_info.json naming its
    files (rows of our own: theirs are not copied)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca_rows(30)))
    (data / "identity.json").write_text(json.dumps(alpaca_rows(10)))
    (data / "dataset_info.json").write_text(json.dumps({
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}, "identity": {"file_name": "identity.json"},
        "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}}))
    for example in EXAMPLES.glob("*.yaml"):
        shutil.copy(example, tmp_path / example.name)
    return tmp_path


def converted(folder: Path, name: str) -> tuple[dict, str]:
    result = invoke("convert-recipe", folder / name)
    assert result.exit_code == 0, result.output
    text = (folder / name.replace(".yaml", ".gpupoor.yaml")).read_text()
    return yaml.safe_load(text), text


@pytest.mark.parametrize("name", SFT)
def test_llama_factorys_sft_examples_convert_and_validate(lf_dir, name):
    recipe, text = converted(lf_dir, name)
    theirs = yaml.safe_load((lf_dir / name).read_text())
    data = recipe["data"]
    assert [(s["name"], s["path"], s["format"], s["max_rows"]) for s in data["datasets"]] == [
        ("identity", "data/identity.json", "alpaca", 1000), ("alpaca_en_demo", "data/alpaca_en_demo.json", "alpaca",
                                                             1000)]
    assert data["max_length"] == 2048 and "chat_template" not in data  # alpaca rows: their template said unused
    assert recipe["peft"]["method"] == theirs["finetuning_type"]
    assert recipe["training"] == {"objective": "sft", "micro_batch_size": 1, "gradient_accumulation_steps":
                                  theirs["gradient_accumulation_steps"], "learning_rate": theirs["learning_rate"],
                                  "epochs": 3, "lr_scheduler": "cosine", "warmup_ratio": 0.1,
                                  **({"eval_every_steps": 500} if "eval_steps" in theirs else {})}
    assert recipe["precision"] == "bf16" and recipe["checkpoint"] == {"every_steps": 500}
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for key in ("do_train", "overwrite_output_dir", "overwrite_cache", "preprocessing_num_workers", "plot_loss",
                "ddp_timeout", "template"):
        assert f"#   {key}: " in header, key  # every key not carried over is said, with why
    if name == "llama3_lora_sft_otfq.yaml":  # QLoRA, and val_size 0.1 as rows of each file
        assert recipe["quantization"] == {"bits": 4} and recipe["peft"]["target_modules"] == "all-linear"
        assert [s["eval_rows"] for s in data["datasets"]] == [1, 3]
    if name == "llama3_full_sft.yaml":
        assert "#   deepspeed: " in header
    for model in ([], ["--set", "model.name_or_path=gpupoor:demo"]):  # the hub id offline, and a model here
        result = invoke("validate", lf_dir / name.replace(".yaml", ".gpupoor.yaml"), *model)
        assert result.exit_code == 0 and ": ok" in result.output, result.output


def test_llama_factorys_dpo_example_converts_to_the_preference_objective(lf_dir):
    recipe, text = converted(lf_dir, "llama3_lora_dpo.yaml")
    assert recipe["training"]["objective"] == "dpo" and recipe["preference"] == {"beta": 0.1}
    assert recipe["data"]["format"] == "preference" and recipe["data"]["chat_template"] == "llama3"
    assert "become gpupoor's preference rows {prompt, chosen, rejected}" in text


def test_an_axolotl_recipe_converts(tmp_path):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in alpaca_rows(8)) + "\n")
    (tmp_path / "ax.yaml").write_text(yaml.safe_dump({
        "base_model": "gpupoor:demo", "adapter": "qlora", "load_in_4bit": True, "sequence_len": 256,
        "datasets": [{"path": "rows.jsonl", "type": "alpaca"}], "micro_batch_size": 2, "num_epochs": 1,
        "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True, "optimizer": "paged_adamw_8bit", "bf16": "auto",
        "val_set_size": 0.25, "wandb_project": "mine", "strict": False}))
    recipe, text = converted(tmp_path, "ax.yaml")
    assert recipe["peft"] == {"rank": 8, "alpha": 16, "target_modules": "all-linear", "method": "lora"}
    assert recipe["quantization"] == {"bits": 4} and recipe["precision"] == "auto"
    assert recipe["data"] == {"path": "rows.jsonl", "format": "alpaca", "eval_rows": 2, "max_length": 256}
    assert recipe["training"]["optimizer"] == "paged_adamw_8bit" and recipe["logging"] == {"project": "mine"}
    result = invoke("validate", tmp_path / "ax.gpupoor.yaml")
    assert result.exit_code == 0, result.output


def test_an_existing_output_is_kept_unless_forced(lf_dir):
    converted(lf_dir, "llama3_lora_sft.yaml")
    again = invoke("convert-recipe", lf_dir / "llama3_lora_sft.yaml")
    assert again.exit_code == 2 and "already exists" in again.output
    assert invoke("convert-recipe", lf_dir / "llama3_lora_sft.yaml", "--force").exit_code == 0
    (lf_dir / "bad.yaml").write_text("- a list\n")
    bad = invoke("convert-recipe", lf_dir / "bad.yaml")
    assert bad.exit_code == 2 and "a recipe is a mapping" in bad.output


# ------------------------------------------------------------------------------------------------ bad input (#56)
def refused(result, *parts: str) -> None:
    """Exit 2, no traceback, the message naming each part."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "run again with --debug" not in result.output, result.output
    for part in parts:
        assert part in result.output, (part, result.output)


@pytest.mark.parametrize("name", ["lf.yaml", "./lf.yaml", "link.yaml", "hard.yaml"])
@pytest.mark.parametrize("force", [False, True])
def test_the_recipe_being_converted_is_never_the_output(lf_dir, monkeypatch, name, force):
    """`convert-recipe lf.yaml --output lf.yaml --force` replaced the user's file with its conversion: the input is
    never an output, however it is named (./, a symlink, a hard link), --force or not."""
    monkeypatch.chdir(lf_dir)
    shutil.copy(lf_dir / "llama3_lora_sft.yaml", "lf.yaml")
    (lf_dir / "link.yaml").symlink_to("lf.yaml")
    (lf_dir / "hard.yaml").hardlink_to("lf.yaml")
    before = Path("lf.yaml").read_bytes()
    result = invoke("convert-recipe", "lf.yaml", "--output", name, *(["--force"] if force else []))
    refused(result, "is the recipe being converted", "even with --force")
    assert Path("lf.yaml").read_bytes() == before and Path("lf.yaml").is_file()


@pytest.mark.parametrize("output", ["data/dataset_info.json", "data/identity.json"])
def test_a_file_the_recipe_reads_is_never_the_output(lf_dir, output):
    before = (lf_dir / output).read_bytes()
    result = invoke("convert-recipe", lf_dir / "llama3_lora_sft.yaml", "--output", lf_dir / output, "--force")
    refused(result, "is a file the recipe reads")
    assert (lf_dir / output).read_bytes() == before


def test_an_output_that_is_a_directory_is_refused(lf_dir):
    refused(invoke("convert-recipe", lf_dir / "llama3_lora_sft.yaml", "--output", lf_dir / "data", "--force"),
            "is a directory")
    assert (lf_dir / "data").is_dir()


# Every key the conversion reads, with values of the wrong kind: each is refused at its file:line.
BAD_VALUES = {
    "dataset": [5, [1, 2]], "datasets": [5, "rows.jsonl"], "dataset_dir": [5, ["data"]],
    "val_size": ["0.1", True, -0.5, 10.5, [1]], "val_set_size": ["0.1", True], "max_samples": ["abc", 1.5, 0, True],
    "finetuning_type": [5, ["lora"]], "adapter": [5], "use_dora": ["true", 1], "load_in_4bit": ["true", 1],
    "load_in_8bit": ["true"], "lora_target_linear": ["all"], "packing": ["false", 0], "sample_packing": ["false"],
    "quantization_bit": ["4", 4.5, True], "pref_loss": [5], "lora_target": [5, [1]], "lora_target_modules": [{"a": 1}],
    "stage": [5, ["sft"]], "rl": [5], "bf16": ["false", 1], "fp16": ["yes"], "template": [5, ["llama3"]],
    "chat_template": [{"a": 1}], "num_train_epochs": ["3", True, 0], "num_epochs": ["abc"], "flash_attn": [5],
    "flash_attention": [[1]], "report_to": [5, [1]], "lr_scheduler_type": [5], "lr_scheduler": [["cosine"]],
    "optim": [5], "optimizer": [{"a": 1}], "output_dir": [5], "wandb_project": [5], "pref_beta": ["0.1", True],
}
COPIED_BAD = [[1], {"a": 1}]  # keys copied as they are: what gpupoor's key does not take either


def copied_keys() -> list[str]:
    from gpupoor.recipe.convert import READ_WITH_OTHERS, SPECIAL
    from gpupoor.recipe.peer_keys import PEER_KEYS

    return [key for key, peer in PEER_KEYS.items() if not peer.note and key not in SPECIAL and key not in
            READ_WITH_OTHERS]


def test_the_table_covers_every_key_the_conversion_reads():
    from gpupoor.recipe.convert import KINDS

    assert set(KINDS) <= set(BAD_VALUES), set(KINDS) - set(BAD_VALUES)
    assert set(BAD_VALUES) | set(copied_keys()) >= set(KINDS) | set(copied_keys())


CASES = [(key, value) for key, values in BAD_VALUES.items() for value in values] + \
    [(key, value) for key in copied_keys() for value in COPIED_BAD] + \
    [("learning_rate", "abc"), ("cutoff_len", "long"), ("trust_remote_code", "maybe"), ("lora_dropout", "x")]


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={json.dumps(v)}" for k, v in CASES])
def test_a_value_of_the_wrong_kind_is_refused_at_its_line(lf_dir, key, value):
    recipe = {"model_name_or_path": "gpupoor:demo", "stage": "sft", "dataset": "identity", key: value}
    (lf_dir / "mine.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    line = list(recipe).index(key) + 1
    result = invoke("convert-recipe", lf_dir / "mine.yaml")
    refused(result, f"mine.yaml:{line}: {key}: ", f"{key} takes ", "convert again")
    assert not (lf_dir / "mine.gpupoor.yaml").exists()


def test_a_value_of_the_right_kind_that_gpupoor_does_not_take_is_noted_not_refused(lf_dir):
    (lf_dir / "mine.yaml").write_text(yaml.safe_dump({"model_name_or_path": "gpupoor:demo", "dataset": "identity",
                                                      "max_steps": -1, "learning_rate": "2e-5"}))
    recipe, text = converted(lf_dir, "mine.yaml")
    assert "max_steps" not in recipe.get("training", {}) and "#   max_steps: -1: gpupoor's training.max_steps" in text
    assert recipe["training"]["learning_rate"] == "2e-5"  # validate reads it as a number, as their tools do


@pytest.mark.parametrize("datasets,parts", [
    ([5], ["ax.yaml:3: datasets[0]: 5 is a whole number", "a mapping such as {path"]),
    ([{"path": "rows.jsonl"}, "more.jsonl"], ["ax.yaml:4: datasets[1]: \"more.jsonl\" is text"]),
    ([{"type": "alpaca"}], ["ax.yaml:3: datasets[0] has no path"]),
    ([{"path": 5}], ["datasets[0].path: 5 is a whole number"]),
    ([{"path": "rows.jsonl", "type": 5}], ["datasets[0].type: 5"]),
    ([{"path": "rows.jsonl", "field_messages": ["m"]}], ["datasets[0].field_messages: [\"m\"] is a list"]),
])
def test_an_axolotl_dataset_entry_that_is_not_one_is_refused_not_written(tmp_path, datasets, parts):
    """`datasets: [5]` was noted as dropped and written as data.path: '5' too."""
    (tmp_path / "ax.yaml").write_text(yaml.safe_dump({"base_model": "gpupoor:demo", "datasets": datasets},
                                                     sort_keys=False))
    refused(invoke("convert-recipe", tmp_path / "ax.yaml"), *parts)
    assert not (tmp_path / "ax.gpupoor.yaml").exists()


def test_an_axolotl_custom_prompt_type_is_noted(tmp_path):
    (tmp_path / "ax.yaml").write_text(yaml.safe_dump({"base_model": "gpupoor:demo", "datasets": [
        {"path": "rows.jsonl", "type": {"field_instruction": "q", "format": "{instruction}"}}]}))
    recipe, text = converted(tmp_path, "ax.yaml")
    assert recipe["data"]["format"] == "alpaca" and "type: a custom prompt format" in text


@pytest.mark.parametrize("info,parts", [
    ('{"identity": {"file_name": "identity.json"}', ["dataset_info.json:1: not valid JSON"]),
    ('{\n  "identity": {\n    "file_name": "identity.json",\n  }\n}', ["dataset_info.json:4: not valid JSON"]),
    ('[{"file_name": "identity.json"}]', ["dataset_info.json: a dataset_info.json is a mapping", "not a list"]),
    ('{"identity": ["identity.json"]}', ["dataset_info.json: 'identity' is a list; a dataset's entry is a mapping"]),
    ('{"identity": {"file_name": "identity.json", "columns": ["instruction"]}}', ["'identity': columns: "
                                                                                 "[\"instruction\"] is a list"]),
    ('{"identity": {"file_name": 5}}', ["'identity': file_name: 5 is a whole number"]),
    ('{"identity": {"file_name": "identity.json", "formatting": ["alpaca"]}}', ["'identity': formatting: "]),
    ('{"identity": {"file_name": "identity.json", "ranking": "yes"}}', ["'identity': ranking: \"yes\" is text"]),
    ('{"identity": {"file_name": "identity.json", "tags": {"role_tag": 5}}}', ["'identity': tags: "]),
])
def test_a_malformed_dataset_info_is_refused_naming_the_file(lf_dir, info, parts):
    (lf_dir / "data" / "dataset_info.json").write_text(info)
    refused(invoke("convert-recipe", lf_dir / "llama3_lora_sft.yaml"), *parts)
    assert not (lf_dir / "llama3_lora_sft.gpupoor.yaml").exists()


def test_a_dataset_info_that_is_not_utf8_is_refused(lf_dir):
    (lf_dir / "data" / "dataset_info.json").write_bytes(b'{"identity": {"file_name": "\xff.json"}}')
    refused(invoke("convert-recipe", lf_dir / "llama3_lora_sft.yaml"), "dataset_info.json:1: not UTF-8 text")


@pytest.mark.parametrize("content,parts", [
    (b"", ["it is empty"]), (b"# only a comment\n", ["it is empty"]),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff", ["not UTF-8 text"]), (b"- a list\n", ["a recipe is a mapping", "not a list"]),
    (b"just text\n", ["a recipe is a mapping", "not text"]), (b"a: 1\nb: c: d\n", ["theirs.yaml:2: not valid YAML"]),
    (b"a: 1\na: 2\n", ["theirs.yaml:2: ", "duplicate key 'a'"]),
])
def test_an_input_that_is_not_a_yaml_recipe_is_refused(tmp_path, content, parts):
    (tmp_path / "theirs.yaml").write_bytes(content)
    refused(invoke("convert-recipe", tmp_path / "theirs.yaml"), *parts)
    assert not (tmp_path / "theirs.gpupoor.yaml").exists()


def test_an_input_that_is_a_directory_or_missing_is_refused(tmp_path):
    refused(invoke("convert-recipe", tmp_path), f"{tmp_path}: is a directory")
    refused(invoke("convert-recipe", tmp_path / "nope.yaml"), "nope.yaml: no such file")
