"""The integration tier of test_memory.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest

from gpupoor.cli import app

from support.memory import _run, runner


def test_fused_and_plain_training_agree_with_accumulation(make_recipe, tmp_path):
    training = {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    fused, output = _run(make_recipe, tmp_path, "fused", training=training)
    plain, _ = _run(make_recipe, tmp_path, "plain", training=training, memory={"fused_cross_entropy": False})
    assert "loss: fused chunked cross-entropy" in output
    for a, b in zip(fused, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_8bit_optimizer_state_is_smaller(make_recipe, tmp_path):
    pytest.importorskip("bitsandbytes")
    sizes = {}
    for optimizer in ("adamw", "adamw_8bit"):
        steps, _ = _run(make_recipe, tmp_path, optimizer, training={"max_steps": 1, "optimizer": optimizer},
                        peft={"rank": 256})  # bnb keeps tensors under 4096 values in 32 bits
        sizes[optimizer] = steps[0]["optimizer_state_mb"]
    assert sizes["adamw_8bit"] < 0.5 * sizes["adamw"]


def test_missing_bitsandbytes_is_a_clear_error_before_loading(make_recipe, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    result = runner.invoke(app, ["train", str(make_recipe(quantization={"bits": 4})), "--output-dir",
                                 str(tmp_path / "run")])
    assert result.exit_code == 2 and "quantization.bits = 4 needs bitsandbytes" in result.output
    assert not (tmp_path / "run").exists()
