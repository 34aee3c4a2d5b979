"""Tiny random-weight models with a tokenizer trained on the spot: for the offline demo, the tests, and
anyone who wants to try a recipe with no download. The real `from_pretrained(path)` path loads them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (like Llama 3's and Qwen's) that adds BOS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def build_tiny_llama(path: str | Path, tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int | None = None, seed: int = 0,
                     tie_embeddings: bool = False, vocab_size: int | None = None) -> Path:
    """Save a random-weight Llama and its tokenizer into `path` with save_pretrained. `vocab_size` may exceed
    the tokenizer's (ids it never produces), to give the model a real model's embedding and head sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate or 4 * hidden, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_embeddings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
