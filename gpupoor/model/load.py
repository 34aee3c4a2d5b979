"""The base model and its tokenizer as the recipe loads them: from a local directory, a GGUF file (gpupoor.model.gguf),
a built-in or the hub, in the precision's dtype, quantized by bitsandbytes when asked, on the run's device (or shrunken with random weights for
`--smoke`), through transformers' public API."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import torch

from gpupoor.errors import UserError
from gpupoor.model import gguf
from gpupoor.hardware import dtype_of
from gpupoor.recipe.schema import ModelSection, QuantizationSection
from gpupoor.units import parse_size


# Dimensions of the shrunken model `--smoke` builds from the real config: small enough to step in
# milliseconds on a CPU, same architecture class so the recipe's code path is the real one.
SMOKE_DIMS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}
# The time plan's step probe (gpupoor.run.step_probe) trains the recipe on the model's own architecture and
# dimensions cut to a few layers, random weights: (layers, of the trained model's layers) while it runs, else None.
# A teacher or reference built meanwhile keeps the same share of its own layers.
_probe_depth: tuple[int, int] | None = None


@contextlib.contextmanager
def probe_depth(layers: int, of: int):
    """Every base model built inside holds `layers` of its trained model's `of` layers (random weights)."""
    global _probe_depth
    before, _probe_depth = _probe_depth, (layers, of)
    try:
        yield
    finally:
        _probe_depth = before


def probing() -> bool:
    return _probe_depth is not None


def model_location(model: ModelSection, base_dir: Path) -> str:
    """A local directory or GGUF file (absolute) or the hub id, as transformers' from_pretrained takes it."""
    from gpupoor.model.builtin import resolve_model_path

    local = resolve_model_path(gguf.joined(model.name_or_path, model.gguf_file), base_dir)
    return str(local) if local is not None else model.name_or_path


def _remembered(kind: str, location: str, model: ModelSection, load):
    """`load()`, or within the step probe a copy of what it returned the first time (a GGUF's metadata takes
    seconds to read, and the probe builds the same model's tokenizer and config once per depth)."""
    if _probe_depth is None and not _remember:
        return load()
    key = (kind, location, model.revision, model.trust_remote_code)
    if key not in _loaded:
        _loaded[key] = load()
    return copy.deepcopy(_loaded[key])


_remember = False  # set by the time plan's child (gpupoor.run.measuring) for its whole life: what it loads, it loads once
_loaded: dict = {}


def remember_loads() -> None:
    global _remember
    _remember = True


def load_tokenizer(location: str, model: ModelSection, key: str = "model.name_or_path"):
    return _remembered("tokenizer", location, model, lambda: _load_tokenizer(location, model, key))


def _load_tokenizer(location: str, model: ModelSection, key: str):
    from transformers import AutoTokenizer

    if gguf.is_gguf(location):
        gguf.require_tokenizer(gguf.read_gguf(Path(location), key), key)
        directory, name = gguf.split(location)
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise gguf.gguf_error(location, key, "tokenizer", exc) from None
    else:
        _require_if_hub(location, key, model.revision)
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, revision=model.revision,
                                                      trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise UserError(f"{key}: cannot load a tokenizer from {location!r}: {exc}") from None
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out of attention and loss, so any id works; EOS is conventional.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _require_if_hub(location: str, key: str, revision: str | None) -> None:
    """A hub id (no such local path): offline, it must be in the hub cache (gpupoor.model.hub says so at once)."""
    if not Path(location).expanduser().exists():
        from gpupoor.model.hub import require_hub_model

        require_hub_model(location, key, revision)


def load_config(location: str, model: ModelSection):
    return _remembered("config", location, model, lambda: _load_config(location, model))


def _load_config(location: str, model: ModelSection):
    from transformers import AutoConfig

    if gguf.is_gguf(location):
        gguf.read_gguf(Path(location))  # the clear errors first: no gguf package, a damaged file, its architecture
        directory, name = gguf.split(location)
        try:
            return AutoConfig.from_pretrained(directory, gguf_file=name)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise gguf.gguf_error(location, "model.name_or_path", "config", exc) from None
    _require_if_hub(location, "model.name_or_path", model.revision)
    try:
        return AutoConfig.from_pretrained(location, revision=model.revision,
                                          trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.name_or_path: cannot load a model config from {location!r}: {exc}",
                        hint="a local directory needs config.json; a hub id needs network or a filled cache") from None


def _set_first(config, names: tuple[str, ...], value) -> None:
    for name in names:
        if hasattr(config, name) and getattr(config, name) is not None:
            setattr(config, name, value)
            return


def shrink_config(config):
    """The same architecture with tiny dimensions, for `--smoke`. Vocab is kept: the real tokenizer runs."""
    config = copy.deepcopy(config)
    dims = SMOKE_DIMS
    _set_first(config, ("hidden_size", "n_embd", "d_model"), dims["hidden"])
    _set_first(config, ("intermediate_size", "n_inner", "ffn_dim"), dims["intermediate"])
    _set_first(config, ("num_hidden_layers", "n_layer", "num_layers"), dims["layers"])
    heads = dims["heads"]
    _set_first(config, ("num_attention_heads", "n_head"), heads)
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None:
        config.num_key_value_heads = dims["kv_heads"] if kv < getattr(config, "num_attention_heads", heads) else heads
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = dims["hidden"] // heads
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[: dims["layers"]]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, dims["layers"])
    return config


def layer_count(config) -> int | None:
    return next((getattr(config, n) for n in LAYER_KEYS if getattr(config, n, None) is not None), None)


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def cut_layers(config, layers: int):
    """The same model with its first `layers` decoder layers: every dimension kept."""
    config = copy.deepcopy(config)
    _set_first(config, LAYER_KEYS, layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, layers)
    return config


def _probe_config(config):
    """The config the step probe builds: its share of this model's layers (at least one)."""
    layers, of = _probe_depth
    own = layer_count(config) or of
    return cut_layers(config, max(1, round(layers * own / max(of, 1))))


def quantization_config(quant: QuantizationSection, precision: str, cpu_offload: bool = False):
    if quant.bits is None:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library
        raise UserError(f"quantization.bits = {quant.bits} needs bitsandbytes, which does not import: {exc}",
                        hint="pip install bitsandbytes, or remove quantization.bits") from None
    from transformers import BitsAndBytesConfig

    compute = precision if quant.compute_dtype == "auto" else quant.compute_dtype
    # With part of the model kept on the CPU, those layers stay unquantized in fp32.
    offload = {"llm_int8_enable_fp32_cpu_offload": True} if cpu_offload else {}
    if quant.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **offload)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant.quant_type,
                              bnb_4bit_use_double_quant=quant.double_quant,
                              bnb_4bit_compute_dtype=dtype_of(compute), **offload)


def load_base_model(location: str, model_cfg: ModelSection, *, quant: QuantizationSection, precision: str,
                    attention: str, device: str, seed: int, smoke: bool = False, max_gpu_memory: str | None = None):
    """The base model as the recipe loads it: in the precision's dtype, quantized when asked, on `device`
    (a shrunken random-weight copy for --smoke)."""
    from transformers import AutoModelForCausalLM

    # A GGUF's loader builds the config from the file itself: reading it here too would parse the file's
    # metadata (its whole vocabulary) once more.
    random = smoke or probing()  # built from the config with random weights, nothing read
    config = None if gguf.is_gguf(location) and not random else load_config(location, model_cfg)
    if config is not None:
        config.use_cache = False  # no KV cache in training: it costs memory and breaks packed attention
    dtype = dtype_of(precision)
    cpu_offload = bool(max_gpu_memory) and device == "cuda"
    quantization = quantization_config(quant, precision, cpu_offload)
    common = {"attn_implementation": attention, "trust_remote_code": model_cfg.trust_remote_code}
    if random:
        torch.manual_seed(seed)
        built = shrink_config(config) if smoke else _probe_config(config)
        model = AutoModelForCausalLM.from_config(built, dtype=dtype, **common)
        if quantization is not None:
            # Quantize the random tiny model the way from_pretrained would, by a save/load round trip.
            model = _requantize(model, quantization, dtype, device, common)
    else:
        try:
            placement = {}
            if cpu_offload:
                # bytes, read by the parser that validated the recipe (accelerate's own knows no TB)
                gpu_bytes = parse_size(max_gpu_memory, "memory.max_gpu_memory")
                placement = {"device_map": "auto", "max_memory": {0: gpu_bytes, "cpu": "1024GiB"}}
            elif quantization is not None or device.startswith("cuda"):
                # straight onto the GPU: a free Colab has less host RAM than GPU memory for the weights
                placement = {"device_map": {"": device}}
            if gguf.is_gguf(location):
                model = load_gguf_model(location, dtype, config=config, quantization=quantization, device=device,
                                        placement=placement, common=common)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    location, config=config, dtype=dtype, revision=model_cfg.revision,
                    quantization_config=quantization, **placement, **common)
        except (OSError, ValueError) as exc:
            raise UserError(f"model.name_or_path: cannot load model weights from {location!r}: {exc}") from None
    model.config.use_cache = False  # (a GGUF's config is built by its loader)
    if quantization is None and not cpu_offload:
        model.to(device)
    elif quantization is not None:
        _prepare_quantized(model)
    return model


def load_gguf_model(location: str, dtype, *, config=None, quantization=None, device: str = "cpu",
                    placement: dict | None = None, common: dict | None = None):
    """A GGUF base through transformers' GGUF loader, each tensor dequantized to the training dtype. A recipe that
    quantizes it (QLoRA) gets the dequantized base quantized by bitsandbytes, by the save/load round trip
    --smoke uses: the GGUF loader does not take a quantization config."""
    from transformers import AutoModelForCausalLM

    gguf.read_gguf(Path(location))  # the clear errors first: no gguf package, a damaged file, its architecture
    placement, common = placement or {}, common or {}
    directory, name = gguf.split(location)
    try:
        # transformers draws its own tqdm bar over the tensors it dequantizes (tqdm.auto, which its
        # disable_progress_bar does not reach): a line of noise in train's, merge's and generate's output.
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config, dtype=dtype,
                                                         **({} if quantization is not None else placement),
                                                         **common)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise gguf.gguf_error(location, "model.name_or_path", "model weights", exc) from None
    _forget_gguf(model)
    return _requantize(model, quantization, dtype, device, common) if quantization is not None else model


def _forget_gguf(model) -> None:
    """Every tensor is dequantized by now, yet transformers keeps a GGUF "quantizer" on the model and its config,
    and refuses to save_pretrained it (merge-lora, the QLoRA round trip) and would write quantization_config into
    a merged config.json: drop those marks, the model is an ordinary one in its dtype."""
    model.hf_quantizer = None
    if "is_quantized" in vars(model):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def save_dequantized(location: str, target: Path, dtype) -> Path:
    """A GGUF base written as an ordinary transformers directory (safetensors, config, tokenizer) in `dtype`."""
    model = load_gguf_model(location, dtype)
    model.save_pretrained(target)
    load_tokenizer(location, ModelSection(name_or_path=location)).save_pretrained(target)
    return target


def _prepare_quantized(model) -> None:
    """Freeze the quantized base. Its unquantized tensors (embeddings, norms, biases) stay in the compute dtype:
    peft's prepare_model_for_kbit_training casts them to fp32, and so did gpupoor until a GPU run measured what
    that costs. An fp32 norm weight turns the norm's output fp32, bitsandbytes returns each matmul in its input's
    dtype, and from the first layer on the whole residual stream is fp32: twice the activations (QLoRA of a
    1.5B model at 8 x 1024 with checkpointing peaked 1.2 GiB above its plan) and a cast before every matmul. The
    norms compute in fp32 inside anyway (RMSNorm upcasts; autocast runs layer_norm in fp32)."""
    for param in model.parameters():
        param.requires_grad = False


def _requantize(model, quantization, dtype, device, common):
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, quantization_config=quantization,
                                                    device_map={"": device}, **common)
