"""Which transformers architectures a GGUF export can write, and what each needs that the tensors alone do not
say: llama.cpp's architecture name, the hyperparameters its loader reads, and the ways llama.cpp's layout differs
from transformers' (the rotary halves of q/k interleaved for llama; Gemma's RMSNorm weights stored as 1 + w).
What llama.cpp's own convert_hf_to_gguf.py does for each family, written from the checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpupoor.errors import UserError


@dataclass(frozen=True)
class Family:
    gguf_arch: str  # llama.cpp's architecture name (general.architecture), a gguf.MODEL_ARCH_NAMES value
    permute_qk: bool = False  # llama: llama.cpp's rope pairs neighbouring dims, transformers' the two halves
    norm_offset: float = 0.0  # Gemma computes x * (1 + w); llama.cpp computes x * w, so the file stores 1 + w
    softcapping: bool = False  # gemma2: attention and final logit softcapping keys
    sliding_window: bool = False  # the family's llama.cpp graph reads attention.sliding_window


# model_type (config.json) -> how llama.cpp names and lays it out. Mistral is llama.cpp's llama architecture.
# transformers' GGUF loader reads all of them back except Gemma 1 (gpupoor.export.quality reads that one itself).
FAMILIES = {
    "llama": Family("llama", permute_qk=True),
    "mistral": Family("llama", permute_qk=True),
    "qwen2": Family("qwen2"),
    "gemma": Family("gemma", norm_offset=1.0),
    "gemma2": Family("gemma2", norm_offset=1.0, softcapping=True, sliding_window=True),
    "gemma3_text": Family("gemma3", norm_offset=1.0, sliding_window=True),
    "phi3": Family("phi3", sliding_window=True),
}


def family_of(config: dict, where: str) -> Family:
    """The export rules of a model's config.json, or a UserError naming its architecture (before any work)."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"{where}: cannot export a {model_type!r} model to GGUF: there is no mapping for that "
                        "architecture", hint="architectures gpupoor exports: " + ", ".join(sorted(FAMILIES))
                        + "; llama.cpp's convert_hf_to_gguf.py converts others from the merged model directory "
                        "(gpupoor merge-lora)")
    return FAMILIES[model_type]


# Rope scalings llama.cpp runs: linear and YaRN as keys, Llama 3's as a per-frequency factor tensor (rope_freqs).
EXPORTED_ROPE = ("default", "linear", "yarn", "llama3")


def rope_scaling(config: dict) -> dict:
    """The rope parameters of the full-attention layers ({"rope_type": "default"} when there is no scaling)."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "full_attention" in parameters:
        parameters = dict(parameters["full_attention"])
    parameters.setdefault("rope_type", parameters.get("type") or "default")
    return parameters


def check_rope(config: dict, where: str) -> None:
    kind = rope_scaling(config)["rope_type"]
    if kind not in EXPORTED_ROPE:
        raise UserError(f"{where}: the model's rope scaling {kind!r} cannot be exported to GGUF by gpupoor (it "
                        f"writes {', '.join(EXPORTED_ROPE)})", hint="convert the merged model (gpupoor merge-lora) "
                        "with llama.cpp's convert_hf_to_gguf.py")


def extra_tensors(config: dict) -> dict[str, np.ndarray]:
    """Tensors llama.cpp needs that the checkpoint does not hold: Llama 3's rope scaling as the factor each rotary
    frequency is divided by (rope_freqs), computed by transformers' own Llama 3 rope so the file runs the rotation
    the model was trained with."""
    if rope_scaling(config)["rope_type"] != "llama3":
        return {}
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(**config), "cpu")
    dim = head_dim(config)
    plain = 1.0 / (rope_theta(config) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return {"rope_freqs.weight": (plain / scaled).numpy().astype(np.float32)}


def rope_theta(config: dict) -> float:
    """The rope base of the full-attention layers (transformers 5 keeps it in rope_parameters, nested per layer
    type for Gemma 3; older configs have rope_theta at the top)."""
    parameters = config.get("rope_parameters") or {}
    if "full_attention" in parameters:
        parameters = parameters["full_attention"]
    return float(parameters.get("rope_theta") or config.get("rope_theta") or 10000.0)


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def write_hyperparameters(writer, config: dict, family: Family) -> None:
    """The {arch}.* keys llama.cpp's loader needs for this family (and transformers' GGUF loader reads back)."""
    heads = config["num_attention_heads"]
    writer.add_context_length(int(config.get("max_position_embeddings") or 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_vocab_size(config["vocab_size"])
    dim = head_dim(config)
    if family.gguf_arch == "phi3":
        rotary = float((config.get("rope_parameters") or {}).get("partial_rotary_factor")
                       or config.get("partial_rotary_factor") or 1.0)
        writer.add_rope_dimension_count(int(rotary * config["hidden_size"]) // heads)
        original = config.get("original_max_position_embeddings")
        if original:
            writer.add_rope_scaling_orig_ctx_len(int(original))
    else:
        writer.add_rope_dimension_count(dim)
    scaling = rope_scaling(config)
    if scaling["rope_type"] in ("linear", "yarn"):
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType[scaling["rope_type"].upper()])
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        if scaling.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    if family.gguf_arch.startswith("gemma"):
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    if family.softcapping:
        for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if config.get(key) is not None:
                add(float(config[key]))
    if family.sliding_window:
        writer.add_sliding_window(int(config.get("sliding_window") or 0))


def _rotary_pairs(weight: np.ndarray, heads: int, interleave: bool) -> np.ndarray:
    """llama.cpp's convert script's reordering of each head's rows of q_proj/k_proj (the rotary halves
    interleaved; transformers' GGUF loader undoes it), or with `interleave` False its inverse."""
    rows = weight.shape[0]
    split = (heads, 2, rows // heads // 2) if interleave else (heads, rows // heads // 2, 2)
    return weight.reshape(*split, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _layout(name: str, tensor: np.ndarray, config: dict, family: Family, to_gguf: bool) -> np.ndarray:
    heads = config["num_attention_heads"]
    if family.permute_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return _rotary_pairs(tensor, heads, to_gguf)
    if family.permute_qk and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return _rotary_pairs(tensor, config.get("num_key_value_heads") or heads, to_gguf)
    if family.norm_offset and name.endswith("norm.weight"):
        offset = np.float32(family.norm_offset)
        return tensor + offset if to_gguf else tensor - offset
    return tensor


def to_llama_cpp_layout(name: str, tensor: np.ndarray, config: dict, family: Family) -> np.ndarray:
    """One transformers tensor (float32) as llama.cpp stores it."""
    return _layout(name, tensor, config, family, to_gguf=True)


def from_llama_cpp_layout(name: str, tensor: np.ndarray, config: dict, family: Family) -> np.ndarray:
    """The inverse of `to_llama_cpp_layout`: a tensor read from a GGUF file as transformers holds it."""
    return _layout(name, tensor, config, family, to_gguf=False)
