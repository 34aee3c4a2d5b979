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


def test_an_adapter_on_a_local_base_loads_as_its_card_says(tiny_model, tmp_path):
    """The card's snippet, run as written (PATH/TO/THIS/DIR replaced): peft finds the local base through
    adapter_config.json, so the card needs no base it cannot name."""
    import re

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "final"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=2, target_modules=["q_proj"])
                   ).save_pretrained(adapter)
    card = weights_card(str(tiny_model), "lora", full=False)
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace("PATH/TO/THIS/DIR", str(adapter))
    assert "BASE" not in snippet and str(tiny_model) not in card.split("---")[1]
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 (the card's own code, on files this test wrote)
    assert scope["model"].peft_config["default"].r == 2
    assert torch.is_tensor(next(scope["model"].parameters()))


def test_an_adapter_on_a_gguf_base_loads_as_its_card_says(tiny_model, tiny_gguf, tmp_path):
    """peft cannot open a GGUF file by its path: the card loads the base with gguf_file=, then the adapter."""
    import re

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "final"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=2, target_modules=["q_proj"])
                   ).save_pretrained(adapter)
    card = weights_card("models/tiny.gguf", "lora", full=False, location=str(tiny_gguf))
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace("PATH/TO/THIS/DIR", str(adapter))
    assert f'gguf_file="{tiny_gguf.name}"' in snippet and "base_model" not in card.split("---")[1]
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 (the card's own code, on files this test wrote)
    assert scope["model"].peft_config["default"].r == 2
