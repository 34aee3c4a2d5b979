"""The unit tier of test_train.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations


def test_shrink_config_keeps_architecture_and_vocab():
    from transformers import Qwen2Config

    from gpupoor.model.load import SMOKE_DIMS, shrink_config

    real = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2)
    small = shrink_config(real)
    assert type(small) is Qwen2Config and small.vocab_size == 151936
    assert small.hidden_size == SMOKE_DIMS["hidden"] and small.num_hidden_layers == SMOKE_DIMS["layers"]
    assert len(small.layer_types) == SMOKE_DIMS["layers"] and small.num_key_value_heads == SMOKE_DIMS["kv_heads"]
    assert real.hidden_size == 1536  # the original is untouched
