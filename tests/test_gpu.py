"""Paths that only a CUDA GPU exercises. Skipped without one; run on the device machine when lent."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from conftest import read_metrics
from gpupoor.cli import app

pytestmark = pytest.mark.gpu


def test_auto_precision_and_device_on_gpu(make_recipe, tmp_path):
    import torch

    result = CliRunner().invoke(app, ["train", str(make_recipe(training={"device": "auto", "max_steps": 4})),
                                      "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    expected = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    assert "device cuda" in result.output and f"precision {expected}" in result.output
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[-1]["peak_mem_mb"] > 0


def test_qlora_on_gpu(make_recipe, tmp_path):
    result = CliRunner().invoke(app, ["train", str(make_recipe(quantization={"bits": 4}, training={"max_steps": 4})),
                                      "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output


def test_flash_attention_packing_equals_one_by_one(tiny_model, tokenizer):
    """flash-attn 2 varlen kernels through restarted position_ids, bf16 on the GPU."""
    pytest.importorskip("flash_attn")
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from gpupoor.data.build import collate_packed
    from gpupoor.data.formats import IGNORE_INDEX
    from test_packing import TEXTS, _dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="flash_attention_2",
                                                 dtype=torch.bfloat16).cuda()
    dataset = _dataset(tokenizer, TEXTS)
    packed = {k: v.cuda() for k, v in collate_packed(dataset, [0, 1, 2, 3]).items()}
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        total = F.cross_entropy(logits[0, :-1].float(), packed["labels"][0, 1:], ignore_index=IGNORE_INDEX,
                                reduction="sum")
        single = 0.0
        for index in range(4):
            one = {k: v.cuda() for k, v in collate_packed(dataset, [index]).items()}
            out = model(input_ids=one["input_ids"], use_cache=False).logits
            single += F.cross_entropy(out[0, :-1].float(), one["labels"][0, 1:], ignore_index=IGNORE_INDEX,
                                      reduction="sum")
    assert torch.allclose(total, single, rtol=2e-2)  # bf16 kernels: same numbers up to rounding
