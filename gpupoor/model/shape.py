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
# The RMSNorms of a decoder layer. Every family has the first two; in Llama's layout the second normalizes the
# MLP's input. Gemma 2 and 3 wrap attention and MLP each in a pre- and a post-norm ("sandwich" norms): there the
# second normalizes the attention's output and pre_feedforward_layernorm the MLP's input.
NORMS = ("input_layernorm", "post_attention_layernorm")
SANDWICH_NORMS = (*NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")
SANDWICH_NORM_MODELS = ("gemma2", "gemma3", "gemma3_text")
# Qwen3 and Gemma 3 normalize every head's query and key (q_norm, k_norm: one head_dim-wide weight each, shared by
# the heads) before the rotation.
QK_NORMS = ("q_norm", "k_norm")
QK_NORM_MODELS = ("qwen3", "gemma3", "gemma3_text")

# The tokenizer classes transformers loads by handing tokenizer.json to the `tokenizers` library as it is; every
# other class (GemmaTokenizer, Qwen2Tokenizer, LlamaTokenizer ...) is rebuilt from the vocabulary and merges
# that transformers first reads into Python, and keeps those copies (transformers 5: TokenizersBackend).
READ_AS_IS_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


@dataclass(frozen=True)
class TokenizerSize:
    """What decides a tokenizer's resident size: its ids, its BPE merges, and how transformers builds it."""

    rows: int  # ids it can produce (vocabulary and added tokens)
    merges: int  # BPE merges (none in a unigram model)
    rebuilt: bool  # from Python copies of the vocabulary and merges (kept), rather than tokenizer.json as it is


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
    tokenizer: TokenizerSize | None = None  # the tokenizer's size, when its files are at hand

    @property
    def tokenizer_rows(self) -> int | None:
        """Ids the tokenizer can produce, when its files are at hand."""
        return self.tokenizer.rows if self.tokenizer else None

    @property
    def norms(self) -> tuple[str, ...]:
        """The layer's RMSNorms, q_norm and k_norm included where the family has them."""
        return ((SANDWICH_NORMS if self.model_type in SANDWICH_NORM_MODELS else NORMS)
                + (QK_NORMS if self.model_type in QK_NORM_MODELS else ()))

    @property
    def mlp_input_norm(self) -> str:
        """The norm whose output the MLP's gate and up projections read."""
        return "pre_feedforward_layernorm" if "pre_feedforward_layernorm" in self.norms else "post_attention_layernorm"

    def norm_width(self, name: str) -> int:
        """Values one norm normalizes per token: its input's width (q_norm and k_norm: every head's query or key)."""
        return {"q_norm": self.q, "k_norm": self.kv}.get(name, self.hidden)

    def norm_rows(self, name: str) -> int:
        """Rows one norm normalizes per token, each with its own 1/rms: one, or every query or key head."""
        return {"q_norm": self.heads, "k_norm": self.kv_heads}.get(name, 1)

    def norm_params(self, name: str) -> int:
        return self.head_dim if name in QK_NORMS else self.hidden

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
        return sum(map(self.norm_params, self.norms)) + ((self.q + 2 * self.kv) if self.qkv_bias else 0)  # + biases

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return (self.embedding_params + head + self.hidden
                + self.layers * (self.layer_linear_params + self.layer_other_params))


FILE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def tokenizer_size(name_or_path: str, base_dir: Path) -> TokenizerSize | None:
    """A local model's tokenizer's size (tokenizer.json, tokenizer_config.json), or None when unknown."""
    local = resolve_model_path(name_or_path, base_dir)
    if local is not None and gguf.is_gguf(str(local)):
        facts = gguf.read_gguf(local)
        # transformers converts a GGUF's tokenizer into a TokenizersBackend, which keeps no Python copies
        # (measured: SmolLM2's, 20 MiB)
        return TokenizerSize(facts.tokens, facts.merges, rebuilt=False) if facts.tokens else None
    path = local / "tokenizer.json" if local is not None else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids |= {token["id"] for token in data.get("added_tokens", [])}
        merges = len(data["model"].get("merges") or [])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return TokenizerSize(len(ids), merges, _tokenizer_class(local) not in READ_AS_IS_TOKENIZERS)


def _tokenizer_class(local: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class (None without one: transformers then picks the model type's own)."""
    try:
        return json.loads((local / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


# Configs that leave tie_word_embeddings out mean their class default, which is True for these.
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def shape_from_config(config: dict, where: str, tokenizer: TokenizerSize | None = None) -> Shape:
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
            file_dtype=file_dtype, tokenizer=tokenizer, logit_postprocessing=logit_postprocessing(config.get))
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
    return shape_from_config(config, source, tokenizer_size(named, loaded.base_dir)), source
