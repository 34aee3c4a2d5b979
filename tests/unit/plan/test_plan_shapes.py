"""gpupoor plan beyond Llama's layer: Gemma 3's four norms a layer and its q/k norms over head_dim-wide heads
(wider than the hidden size) against what autograd keeps and what transformers builds, and the tokenizer's
resident size read from its files (measured by bench/plan_accuracy.py --calibrate-tokenizers: a process's
resident size is no unit test's)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gpupoor.plan.settings import resolve_settings
from gpupoor.model.shape import LINEARS, shape_from_config, tokenizer_size
from gpupoor.plan.terms import TOKENIZER_BYTES, layer_saved_bytes_per_token, tokenizer_bytes, trainable_params
from gpupoor.recipe.schema import Recipe

from support.memory import saved_tensor_bytes

# Gemma 3 270M's proportions, shrunk: 4 query heads and 1 key/value head of head_dim 32, so q (128) is twice the
# hidden size (64); sliding layers with a full one between.
GEMMA3 = dict(vocab_size=300, hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=1,
              head_dim=32, query_pre_attn_scalar=32, sliding_window=512, tie_word_embeddings=True,
              final_logit_softcapping=None, attn_logit_softcapping=None, use_cache=False)
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def gemma3_config(layers: int):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(num_hidden_layers=layers, layer_types=LAYER_TYPES[:layers], **GEMMA3)


def tiny_gemma3_with_lora(layers: int, autocast_bf16: bool = False):
    """A random-weight Gemma 3 text model with LoRA r8 on every linear through peft, trainable tensors in fp32 and
    input grads off, as gpupoor trains. Returns (model, decoder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if autocast_bf16 else torch.float32
    model = Gemma3ForCausalLM._from_config(gemma3_config(layers), attn_implementation="sdpa", dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.get_base_model().disable_input_require_grads()
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model.train(), model.get_base_model().model


def packed_forward_saved_bytes(layers: int, autocast_bf16: bool, batch: int = 2, seq: int = 64) -> int:
    """What autograd keeps over a forward of packed rows (two examples a row: position_ids restart, so
    transformers masks attention block-diagonally, as gpupoor's packed batches do)."""
    model, decoder = tiny_gemma3_with_lora(layers, autocast_bf16)
    ids = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq // 2).repeat(2).expand(batch, -1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        return saved_tensor_bytes(model, lambda: decoder(input_ids=ids, position_ids=positions))


def gemma3_settings(precision: str = "fp32", seq: int = 64, batch: int = 2, **peft):
    shape = shape_from_config({**gemma3_config(3).to_dict(), "model_type": "gemma3_text"}, "test")
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "precision": precision,
                                    "data": {"path": "x.jsonl", "max_length": seq, "sampler": "packed"},
                                    "peft": {"rank": 8, **peft}, "training": {"micro_batch_size": batch}})
    return shape, resolve_settings(recipe, "cpu", shape)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gemma3_layer_keeps_what_the_plan_counts(precision):
    """One sliding-window layer's saved tensors (a 3-layer model minus a 2-layer one, whose first two layers are
    alike) against the plan's per-layer term: four norms' inputs and 1/rms, q_norm's and k_norm's over every head,
    and the packed rows' mask. Counted as Llama's two norms, the plan was 17% short (24% under bf16 autocast)."""
    half = precision == "bf16"
    measured = packed_forward_saved_bytes(3, half) - packed_forward_saved_bytes(2, half)
    shape, settings = gemma3_settings(precision)
    assert shape.norms == ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm", "q_norm", "k_norm")
    planned = layer_saved_bytes_per_token(shape, settings, 64, masked=True) * 128
    assert planned == pytest.approx(measured, rel=0.10 if half else 0.02), (planned, measured)


def test_gemma3_parameters_norms_included_are_what_transformers_and_peft_build():
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM(gemma3_config(3))
    shape, settings = gemma3_settings(method="full")
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert trainable_params(shape, settings) == shape.total_params
    lora = get_peft_model(model, LoraConfig(r=8, target_modules=list(LINEARS)))
    _, settings = gemma3_settings()
    assert trainable_params(shape, settings) == sum(p.numel() for p in lora.parameters() if p.requires_grad)


def sentencepiece_like_tokenizer(folder, ids: int) -> int:
    """A byte-fallback BPE tokenizer.json laid out as Gemma's is at `folder`, with `ids` ids and about two merges
    each (every piece x+y+z made so that x+y and y+z are pieces too, every split listed, as transformers'
    SentencePiece converter lists them). Returns its merges."""
    from tokenizers import Tokenizer, models, normalizers

    rng = random.Random(0)
    alphabet = ["▁"] + [chr(c) for c in range(0x21, 0x7F)] + [chr(0x4E00 + k) for k in range(60)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)])}
    vocab.update({char: len(vocab) + n for n, char in enumerate(alphabet)})
    pieces, made_of = list(alphabet), {}

    def add(piece, left, right):
        if piece not in vocab and len(vocab) < ids:
            vocab[piece] = len(vocab)
            pieces.append(piece)
            made_of[piece] = (left, right)

    while len(vocab) < ids:
        grown = pieces[int(len(pieces) * rng.random() ** 0.5)]
        char = alphabet[int(len(alphabet) * rng.random() ** 2)]
        if grown in made_of:
            add(made_of[grown][1] + char, made_of[grown][1], char)
        add(grown + char, grown, char)
    merges = [(p[:i], p[i:]) for p in pieces for i in range(1, len(p)) if p[:i] in vocab and p[i:] in vocab]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    return len(merges)


def loaded_as(folder, tokenizer_class: str):
    """`folder`'s tokenizer.json beside a tokenizer_config.json naming `tokenizer_class`, in a folder of its own."""
    target = folder.with_name(f"{folder.name}-{tokenizer_class}")
    target.mkdir()
    (target / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (target / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>"}))
    return target


def test_the_plan_reads_the_tokenizers_size_and_counts_what_it_keeps_resident(tmp_path):
    """tokenizer.json's ids and merges and tokenizer_config.json's class decide the tokenizer term of the CPU's
    overhead: a class of the model's own (GemmaTokenizer) is rebuilt from Python copies of the vocabulary and merges
    and keeps them, TokenizersBackend reads tokenizer.json as it is (gpupoor.plan.terms.TOKENIZER_BYTES, measured
    by `python bench/plan_accuracy.py --calibrate-tokenizers`: 60 and 28 MiB at this size)."""
    from gpupoor.plan.peak import plan_terms

    merges = sentencepiece_like_tokenizer(tmp_path / "spm", 65536)
    overheads = {}
    for tokenizer_class, rebuilt in (("GemmaTokenizer", True), ("TokenizersBackend", False)):
        size = tokenizer_size(str(loaded_as(tmp_path / "spm", tokenizer_class)), tmp_path)
        assert (size.rows, size.merges, size.rebuilt) == (65536, merges, rebuilt)
        shape = shape_from_config({**gemma3_config(1).to_dict(), "vocab_size": 65536}, "test", size)
        _, settings = gemma3_settings()
        overhead = next(t for t in plan_terms(shape, settings, False)[0] if t.key == "overhead")
        assert f"{65536:,} ids and {merges:,} merges" in overhead.detail
        overheads[tokenizer_class] = overhead.bytes
    # rebuilt: more a merge (each kept as a Python tuple of two strings), a little less an id
    (id_rebuilt, merge_rebuilt), (id_as_is, merge_as_is) = TOKENIZER_BYTES[True], TOKENIZER_BYTES[False]
    assert overheads["GemmaTokenizer"] - overheads["TokenizersBackend"] == pytest.approx(
        65536 * (id_rebuilt - id_as_is) + merges * (merge_rebuilt - merge_as_is))
    unknown = shape_from_config(gemma3_config(1).to_dict(), "test")  # a hub id whose tokenizer is not at hand
    assert tokenizer_bytes(unknown)[1] == "300 ids and 300 merges, rebuilt by transformers (assumed)"
