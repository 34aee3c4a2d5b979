"""Shared by the starting_points tests (moved from unit/recipe/test_starting_points.py, whose tests still use them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.cli import invoke
from support.runs import read_metrics


def train(recipe: Path, run: Path, monkeypatch) -> Path:
    result = invoke("train", recipe, "--output-dir", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    return run


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


def assert_close(ours: dict, theirs: dict, rel: float) -> None:
    assert ours.keys() == theirs.keys()
    for key in ours:
        scale = theirs[key].abs().max().item()
        assert (ours[key] - theirs[key]).abs().max().item() <= rel * scale, key


# One optimizer step whose update is ~1e-12 of a weight: the final adapter is the adapter the run started from.
STILL = {"max_steps": 1, "learning_rate": 1e-12}


STARTS = {"lora": ({"method": "lora", "dropout": 0.1}, {}), "dora": ({"method": "dora"}, {}),
          "ia3": ({"method": "ia3"}, {}), "qlora": ({"method": "lora"}, {"quantization": {"bits": 4}})}


def final_eval_loss(run: Path) -> float:
    return [record for record in read_metrics(run) if "eval_loss" in record][-1]["eval_loss"]


@pytest.fixture()
def foreign_adapter(tiny_model, tmp_path) -> Path:
    """A PEFT adapter saved by peft itself (no gpupoor manifest), LoRA on q_proj and v_proj, B not zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    model.save_pretrained(tmp_path / "foreign")
    return tmp_path / "foreign"
