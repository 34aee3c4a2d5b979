"""The integration tier of test_merge_methods.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations
import pytest
from support.merge import assert_merges_as_trained_only_into_the_dequantized_base

from support.merge_methods import train_run


@pytest.mark.parametrize("method", ["dora", "ia3"])
def test_qlora_merge_reproduces_the_trained_model(method, tiny_model, tmp_path):
    """A run trained on a 4-bit base merges into the dequantized base: logits as trained; into the original
    full-precision base they differ by the quantization error."""
    pytest.importorskip("bitsandbytes")
    run = train_run(tmp_path, tiny_model, f"q{method}", method, quantization={"bits": 4})
    kind = {"dora": "lora_magnitude_vector", "ia3": "ia3_l"}[method]
    from safetensors.torch import load_file

    assert any(kind in key for key in load_file(run / "final" / "adapter_model.safetensors"))
    assert_merges_as_trained_only_into_the_dequantized_base(run, tmp_path)
