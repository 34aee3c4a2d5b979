"""The GGUF `--quant` names: for each, the GGML type of the matrices, the file type it declares, and the types
llama-quantize's mixes give the head and some layers (gpupoor/export/gguf/tensor_types.py applies them tensor by
tensor). A table without numpy or gguf, so that the CLI's choices and help are read from it at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quant:
    name: str
    base: str  # the GGML type of the matrices (a GGMLQuantizationType name)
    file_type: str  # general.file_type (a gguf.LlamaFileType name)
    more_bits: str | None = None  # attn_v / ffn_down on use_more_bits layers (the _M mixes)
    fused_qkv: str | None = None  # phi3's attn_qkv
    output: str | None = "Q6_K"  # the head (or the tied embedding); None: the base type


QUANTS = {q.name: q for q in (
    Quant("f32", "F32", "ALL_F32", output=None),
    Quant("f16", "F16", "MOSTLY_F16", output=None),
    Quant("bf16", "BF16", "MOSTLY_BF16", output=None),
    Quant("q8_0", "Q8_0", "MOSTLY_Q8_0", output=None),
    Quant("q6_k", "Q6_K", "MOSTLY_Q6_K"),
    Quant("q5_k_m", "Q5_K", "MOSTLY_Q5_K_M", more_bits="Q6_K", fused_qkv="Q6_K"),
    Quant("q5_1", "Q5_1", "MOSTLY_Q5_1"),
    Quant("q5_0", "Q5_0", "MOSTLY_Q5_0"),
    Quant("q4_k_m", "Q4_K", "MOSTLY_Q4_K_M", more_bits="Q6_K", fused_qkv="Q5_K"),
    Quant("q4_1", "Q4_1", "MOSTLY_Q4_1"),
    Quant("q4_0", "Q4_0", "MOSTLY_Q4_0"),
    Quant("iq4_nl", "IQ4_NL", "MOSTLY_IQ4_NL"),
)}
