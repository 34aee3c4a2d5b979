"""`--quant` names and, for each, the GGML type of every tensor: llama.cpp's llama-quantize rules (src/llama-quant.cpp,
llama_tensor_get_type) where it has them, so a file from gpupoor is the file llama.cpp would have written:

- 1-D tensors (norms, biases) stay F32 in every file, as llama.cpp keeps them.
- The output head (or the embedding table a tied model uses as its head) gets Q6_K in every 4/5/6-bit file; its
  quantization costs the most quality per bit.
- q4_k_m / q5_k_m give attn_v and ffn_down Q6_K on the layers `use_more_bits` picks (the first and last eighth and
  every third between), and phi3's fused attn_qkv one step more (Q5_K / Q6_K).
- A row length the type's block does not divide falls back as llama.cpp does: K types (256) to Q5_0 / Q5_1 /
  Q8_0, 32-blocks to F16. SmolLM2's width 576 is not a multiple of 256, so most of its q4_k_m matrices are Q5_0,
  as in llama.cpp's own files of it.

iq4_nl (the codebook type) follows q4_0's rules, not llama-quantize's IQ4_NL mix (which puts some layers at
Q5_K), so the two compare at the same size."""

from __future__ import annotations

import re

import numpy as np

from gpupoor.export.gguf.quant_names import Quant


def _types():
    """gguf.GGMLQuantizationType: gguf is an optional extra, imported when an export runs."""
    import gguf

    return gguf.GGMLQuantizationType


# llama-quantize's fallback where a K type's 256-block does not divide the row length.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# The types the gguf package reads but cannot write: gpupoor.export.gguf.k_quantizers writes them.
GPUPOOR_WRITES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes (integer division as in C)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(quant: Quant, gguf_name: str, shape: tuple[int, ...], layers: int, is_head: bool):
    """The GGMLQuantizationType of one tensor (numpy shape, rows x row length) in this quant's file."""
    types = _types()
    if len(shape) < 2 or quant.base == "F32":
        return types.F32
    wanted = quant.base
    layer = int(match.group(1)) if (match := _LAYER.match(gguf_name)) else None
    if is_head and quant.output:
        wanted = quant.output
    elif quant.fused_qkv and ".attn_qkv." in gguf_name:
        wanted = quant.fused_qkv
    elif quant.more_bits and layer is not None and (".attn_v." in gguf_name or ".ffn_down." in gguf_name) \
            and use_more_bits(layer, layers):
        wanted = quant.more_bits
    return _fitting(types[wanted], shape[-1])


def _fitting(qtype, row_length: int):
    """`qtype`, or llama.cpp's fallback when its block does not divide the row length."""
    import gguf

    types = _types()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if row_length % block == 0:
        return qtype
    if qtype.name in K_FALLBACK:
        return _fitting(types[K_FALLBACK[qtype.name]], row_length)
    return types.F16


def nbytes(qtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy shape `shape` stored as `qtype`."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def encode(weights: np.ndarray, qtype) -> np.ndarray:
    """A float32 tensor as the bytes (or float array) gguf.GGUFWriter writes for `qtype`: the gguf package's own
    quantizers where it has one, gpupoor's K-quant and codebook ones (gpupoor.export.gguf.k_quantizers) for the rest."""
    import gguf

    types = _types()
    if qtype == types.F32:
        return np.ascontiguousarray(weights, dtype=np.float32)
    if qtype == types.F16:
        return weights.astype(np.float16)
    if qtype.name in GPUPOOR_WRITES:
        from gpupoor.export.gguf import k_quantizers

        return k_quantizers.quantize(weights, qtype)
    return gguf.quants.quantize(weights, qtype)
