"""A model's shape for the plan: its config.json found without its weights (a local directory, a GGUF file's
metadata, the hub cache, the configs gpupoor ships, or the hub), and the dimensions of a decoder-only transformer read from it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpupoor.decisions import logit_postprocessing
from gpupoor.errors import UserError
from gpupoor.model import gguf
from gpupoor.model.builtin import resolve_model_path
from gpupoor.recipe.loading import LoadedRecipe

BUNDLED_CONFIGS = Path(__file__).parent / "model_configs"

# The linear modules of a Llama-family decoder layer: name -> (input features, output features) as a function
# of the shape.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class Shape:
    """The dimensions of a decoder-only transformer that decide its memory."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    file_dtype: str | None = None  # dtype of the weights on disk (config's dtype), fp32 | bf16 | fp16
    logit_postprocessing: str | None = None  # the config key that soft-caps or scales the logits (Gemma 2, Cohere)
    tokenizer_rows: int | None = None  # ids the tokenizer can produce, when its files are at hand

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linear(self, name: str) -> tuple[int, int]:
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q), "k_proj": (h, self.kv), "v_proj": (h, self.kv), "o_proj": (self.q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[name]

    def linear_params(self, name: str) -> int:
        """Parameters of one linear module: its weight, and its bias where the model has one."""
        a, b = self.linear(name)
        return a * b + (b if self.qkv_bias and name in ("q_proj", "k_proj", "v_proj") else 0)

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in map(self.linear, LINEARS))

    @property
    def layer_other_params(self) -> int:
        return 2 * self.hidden + ((self.q + 2 * self.kv) if self.qkv_bias else 0)  # norms, biases

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return (self.embedding_params + head + self.hidden
                + self.layers * (self.layer_linear_params + self.layer_other_params))


FILE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def tokenizer_rows(name_or_path: str, base_dir: Path) -> int | None:
    """How many ids a local model's tokenizer can produce (tokenizer.json), or None when unknown."""
    local = resolve_model_path(name_or_path, base_dir)
    if local is not None and gguf.is_gguf(str(local)):
        return gguf.read_gguf(local).tokens or None
    path = local / "tokenizer.json" if local is not None else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids |= {token["id"] for token in data.get("added_tokens", [])}
        return len(ids)
    except (ValueError, KeyError, TypeError):
        return None


# Configs that leave tie_word_embeddings out mean their class default, which is True for these.
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def shape_from_config(config: dict, where: str, tokenizer_rows: int | None = None) -> Shape:
    file_dtype = FILE_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    config = config.get("text_config") or config  # multimodal wrappers keep the language model here
    moe = [key for key in MOE_KEYS if config.get(key)]
    if moe:
        raise UserError(f"{where}: a mixture-of-experts model ({moe[0]} = {config[moe[0]]}): gpupoor plan models "
                        "dense decoders of the Llama family only")
    try:
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        shape = Shape(
            model_type=config.get("model_type", "?"), hidden=hidden, intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"], heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", config.get("model_type") in TIED_BY_DEFAULT)),
            qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
            file_dtype=file_dtype, tokenizer_rows=tokenizer_rows, logit_postprocessing=logit_postprocessing(config.get))
    except KeyError as exc:
        raise UserError(f"{where}: the model config has no {exc.args[0]!r}: gpupoor plan models decoder-only "
                        "transformers of the Llama family (Llama, Qwen2/3, Mistral, Gemma ...)") from None
    except (TypeError, ZeroDivisionError):
        shape = None
    dims = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab")
    if shape is None or not all(isinstance(getattr(shape, d), int) and getattr(shape, d) > 0 for d in dims):
        raise UserError(f"{where}: the model config's dimensions (hidden_size, intermediate_size, "
                        "num_hidden_layers, num_attention_heads, vocab_size ...) must be positive integers")
    return shape


def _read_json(path: Path, key: str = "model.name_or_path") -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: {path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{key}: {path} is not a JSON object")
    return data


def require_model_dir(local: Path, key: str) -> None:
    """A local model path (named by recipe key `key`) is a directory with a config.json, or a UserError saying
    what it is instead: a file, nothing, or a directory of something else."""
    if local.exists() and not local.is_dir():
        raise UserError(f"{key}: {local} is a file; expected a model directory (config.json and weights, as "
                        "save_pretrained writes it) or a hub id (owner/name)", hint="name the directory that holds it")
    if not local.is_dir():
        raise UserError(f"{key}: {local} does not exist",
                        hint="relative paths resolve against the recipe file's directory")
    if not (local / "config.json").is_file():
        raise UserError(f"{key}: {local} has no config.json; it is not a model saved with save_pretrained")


def find_config(name_or_path: str, base_dir: Path, revision: str | None = None,
                key: str = "model.name_or_path") -> tuple[dict, str]:
    """The model's config.json without its weights: a local directory, the hub cache, the configs gpupoor
    ships for its own recipes, or (network allowing) the hub's config.json alone. Returns (config, source).
    `key`: the recipe key that named the model (the student's, or distill.teacher), for errors."""
    local = resolve_model_path(name_or_path, base_dir)
    if local is not None and gguf.is_gguf(str(local)):
        return dict(gguf.read_gguf(local, key).config), str(local)  # its metadata: the tensors are not read
    if local is not None:
        require_model_dir(local, key)
        return _read_json(local / "config.json", key), str(local / "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # a malformed id: handled below like an unknown one
        cached = None
    if isinstance(cached, str):
        return _read_json(Path(cached), key), cached
    bundled = BUNDLED_CONFIGS / (name_or_path.replace("/", "--") + ".json")
    if bundled.is_file():
        return _read_json(bundled, key), f"gpupoor's copy of {name_or_path}'s config.json"
    from gpupoor.model.hub import hub_reachable

    if os.environ.get("HF_HUB_OFFLINE") != "1" and hub_reachable():  # (asked once per process)
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(name_or_path, "config.json", revision=revision)
            return _read_json(Path(path), key), path
        except Exception as exc:
            raise UserError(f"{key}: cannot read {name_or_path}'s config.json ({type(exc).__name__}: "
                            f"{exc})", hint="check the name, or log in for a gated model (hf auth login)") from None
    from gpupoor.model.hub import offline_cause

    cause = offline_cause()
    raise UserError(f"{key}: {name_or_path}'s config.json is not in the local hub cache and {cause}",
                    hint="unset HF_HUB_OFFLINE (plan downloads config.json only)" if cause.startswith("HF_HUB")
                    else f"download it where there is a network (hf download {name_or_path}), or set {key} to a "
                    "local model directory")


def load_teacher_shape(loaded: LoadedRecipe) -> tuple[Shape | None, str | None]:
    """The distillation teacher's dimensions, found like the student's (a local path is relative to the
    recipe); (None, None) without distillation."""
    distill = loaded.recipe.distill
    if distill is None:
        return None, None
    config, source = find_config(distill.teacher, loaded.base_dir, distill.revision, key="distill.teacher")
    return shape_from_config(config, source), source


def load_shape(loaded: LoadedRecipe) -> tuple[Shape, str]:
    model = loaded.recipe.model
    named = gguf.joined(model.name_or_path, model.gguf_file)
    config, source = find_config(named, loaded.base_dir, model.revision)
    return shape_from_config(config, source, tokenizer_rows(named, loaded.base_dir)), source
