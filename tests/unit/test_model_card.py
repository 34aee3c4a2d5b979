"""Model cards the hub accepts: base_model is a hub id or absent, never a local path."""

from __future__ import annotations

import pytest

from gpupoor.storage.model_card import card_text, hub_id, weights_card


@pytest.mark.parametrize("name,expected", [
    ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("/root/.cache/gpupoor/real/SmolLM2-135M-Instruct.Q4_1.gguf", None), ("~/models/mine", None),
    ("./runs/x/final", None), ("gpupoor:demo", None), ("model.gguf", None), ("gpt2", None), (None, None)])
def test_only_a_hub_repository_id_is_a_base_model(name, expected):
    assert hub_id(name) == expected


def test_a_directory_named_like_a_hub_id_is_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_id("org/model") is None


def test_the_cards_metadata_reads_back_through_huggingface_hub():
    from huggingface_hub import ModelCard

    card = ModelCard(weights_card("Qwen/Qwen2.5-1.5B", "lora", full=False))
    assert card.data.base_model == "Qwen/Qwen2.5-1.5B" and card.data.library_name == "peft"
    assert set(card.data.tags) >= {"gpupoor", "lora"}
    local = ModelCard(card_text("/data/models/mine", "transformers", ["merged"], "# body"))
    assert local.data.base_model is None and "/data/models" not in local.content.split("---")[1]
    assert local.data.library_name == "transformers" and "# body" in local.text
