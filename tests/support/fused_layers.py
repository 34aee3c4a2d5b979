"""Shared by the fused_layers tests (moved from unit/model/test_fused_layers.py, whose tests still use them)."""

from __future__ import annotations

import torch


VOCAB = 101


def tiny_family(family: str, dtype=torch.float64, layers: int = 2, **extra):
    """A random-weight model of `family` (hidden 32, intermediate 64, GQA 4/2) in `dtype`."""
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "gemma": "Gemma"}
    config_class = getattr(transformers, f"{names[family]}Config")
    model_class = getattr(transformers, f"{names[family]}ForCausalLM")
    config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=128,
                          use_cache=False, **extra)
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation="sdpa", dtype=dtype)


def with_lora(model, **options):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B random too, so the adapters change the output and get gradients of every kind.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=options.pop("target_modules", "all-linear"),
                        init_lora_weights=False, **options)
    return get_peft_model(model, config)
