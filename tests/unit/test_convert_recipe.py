"""`gpupoor convert-recipe`: LLaMA-Factory's own example recipes (tests/data/llama-factory, Apache-2.0) and an axolotl
one become gpupoor recipes that validate, with every key not carried over said at the top."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import alpaca_rows, invoke

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "llama-factory"
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
