"""Base model + tokenizer + quantization + PEFT wrapping, through the public transformers/peft APIs."""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gpupoor.decisions import ia3_modules, trained_layer_indices
from gpupoor.errors import UserError
from gpupoor.hardware import dtype_of
from gpupoor.recipe.schema import DistillSection, ModelSection, PeftSection, QuantizationSection
from gpupoor.units import parse_size

# Dimensions of the shrunken model `--smoke` builds from the real config: small enough to step in
# milliseconds on a CPU, same architecture class so the recipe's code path is the real one.
SMOKE_DIMS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}


@dataclass
class ModelSummary:
    total_params: int
    trainable_params: int
    weight_bytes: int

    @property
    def trainable_percent(self) -> float:
        return 100.0 * self.trainable_params / max(self.total_params, 1)


def model_location(model: ModelSection, base_dir: Path) -> str:
    """A local directory (absolute) or the hub id, as transformers' from_pretrained takes it."""
    from gpupoor.model.builtin import resolve_model_path

    local = resolve_model_path(model.name_or_path, base_dir)
    return str(local) if local is not None else model.name_or_path


def load_tokenizer(location: str, model: ModelSection):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, revision=model.revision,
                                                  trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.name_or_path: cannot load a tokenizer from {location!r}: {exc}") from None
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out of attention and loss, so any id works; EOS is conventional.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(location: str, model: ModelSection):
    from transformers import AutoConfig

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


def build_model(location: str, model_cfg: ModelSection, peft_cfg: PeftSection, quant: QuantizationSection,
                precision: str, attention: str, device: str, gradient_checkpointing: bool | str, seed: int,
                smoke: bool = False, max_gpu_memory: str | None = None, resuming: bool = False):
    """The model to train on `device`: the base with the recipe's method applied (peft adapters on a frozen
    base, or the base's own chosen weights for `full`). With `max_gpu_memory` on a GPU, accelerate's device
    map keeps what does not fit in CPU memory. `resuming`: a checkpoint's weights replace the adapter's at once,
    so peft.init_adapter is not read (it may be gone by now)."""
    if resuming and peft_cfg.init_adapter is not None:
        peft_cfg = peft_cfg.model_copy(update={"init_adapter": None})
    model = load_base_model(location, model_cfg, quant, precision, attention, device, seed, smoke, max_gpu_memory)
    if gradient_checkpointing:
        # Non-reentrant: gives bitwise-equal gradients, and needs no input that requires grad. Offloading the
        # saved inputs to the host only means something when they live on a GPU.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              offload=gradient_checkpointing == "offload" and device == "cuda")
        _no_input_grads(model)
    check_module_names(model, peft_cfg)
    torch.manual_seed(seed)  # LoRA A is randomly initialized: make it a function of the seed
    model = apply_method(model, peft_cfg, load_init_weights=not smoke)
    _no_input_grads(model.get_base_model() if hasattr(model, "get_base_model") else model)
    # peft keeps LoRA weights in fp32 but leaves modules_to_save (and `full` its weights) in the base dtype: an fp16
    # copy cannot be unscaled by the GradScaler and a bf16 one loses small AdamW updates. Trainable tensors are fp32.
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    if hasattr(model, "peft_config"):
        # What a user loads the adapter onto: the hub id as named, or the local directory as an absolute path.
        model.peft_config["default"].base_model_name_or_path = location
        model.peft_config["default"].revision = model_cfg.revision
    return model


def _no_input_grads(model) -> None:
    """transformers (enabling checkpointing) and peft (wrapping) each make the embedding output require grad, so
    gradients reach adapters through *reentrant* checkpoints. Non-reentrant ones need no such thing, and with it
    every frozen layer below the first trainable one would keep (or recompute) activations for a backward that
    needs none. Each registration replaces the handle the last one kept: remove each as it is made."""
    with contextlib.suppress(AttributeError):  # no hook registered
        model.disable_input_require_grads()


def load_base_model(location: str, model_cfg: ModelSection, quant: QuantizationSection, precision: str,
                    attention: str, device: str, seed: int, smoke: bool = False, max_gpu_memory: str | None = None):
    """The base model as the recipe loads it: in the precision's dtype, quantized when asked, on `device`
    (a shrunken random-weight copy for --smoke)."""
    from transformers import AutoModelForCausalLM

    config = load_config(location, model_cfg)
    config.use_cache = False  # no KV cache in training: it costs memory and breaks packed attention
    dtype = dtype_of(precision)
    cpu_offload = bool(max_gpu_memory) and device == "cuda"
    quantization = quantization_config(quant, precision, cpu_offload)
    common = {"attn_implementation": attention, "trust_remote_code": model_cfg.trust_remote_code}
    if smoke:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(shrink_config(config), dtype=dtype, **common)
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
            model = AutoModelForCausalLM.from_pretrained(
                location, config=config, dtype=dtype, revision=model_cfg.revision, quantization_config=quantization,
                **placement, **common)
        except (OSError, ValueError) as exc:
            raise UserError(f"model.name_or_path: cannot load model weights from {location!r}: {exc}") from None
    if quantization is None and not cpu_offload:
        model.to(device)
    elif quantization is not None:
        _prepare_quantized(model)
    return model


def build_teacher(distill: DistillSection, model_cfg: ModelSection, precision: str, attention: str, device: str,
                  seed: int, smoke: bool = False):
    """The frozen distillation teacher: loaded like a base (4/8-bit with distill.bits), in eval mode, no grads.
    Returns (teacher, its tokenizer)."""
    from gpupoor.model.builtin import resolve_model_path

    local = resolve_model_path(distill.teacher, Path.cwd())
    location = str(local) if local is not None else distill.teacher
    section = ModelSection(name_or_path=location, revision=distill.revision,
                           trust_remote_code=model_cfg.trust_remote_code)
    teacher = load_base_model(location, section, QuantizationSection(bits=distill.bits), precision, attention, device,
                              seed, smoke)
    for param in teacher.parameters():
        param.requires_grad = False
    return teacher.eval(), load_tokenizer(location, section)


def build_reference(model_cfg: ModelSection, bits: int | None, precision: str, attention: str, device: str,
                    seed: int, smoke: bool = False, quant: QuantizationSection | None = None):
    """DPO's frozen reference copy (preference.reference: copy): the base model loaded again like a teacher
    (4/8-bit with preference.reference_bits; --smoke's copy is built from the same seed as the trained base), in
    eval mode, no grads. `quant`: the recipe's quantization section; a reference quantized to the same bits takes
    its settings (type, double quantization, compute dtype), so it is the very base the policy trains on."""
    location = model_location(model_cfg, Path.cwd())
    same = quant is not None and bits is not None and quant.bits == bits
    settings = quant if same else QuantizationSection(bits=bits)
    reference = load_base_model(location, model_cfg, settings, precision, attention, device, seed, smoke)
    for param in reference.parameters():
        param.requires_grad = False
    # bitsandbytes 4-bit layers in eval mode repack their weights on the CPU (other logits, and an error for a
    # layer narrower than a quantization block): a quantized copy there runs in train mode, as the adapter-off
    # reference does.
    return reference.train(bits == 4 and device.startswith("cpu"))


def decoder_layer_count(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "num_hidden_layers", None) if config is not None else None


def last_layer_indices(model, peft_cfg: PeftSection) -> list[int] | None:
    """The decoder layers that train (`peft.last_layers`), or None for all of them."""
    if peft_cfg.last_layers is None:
        return None
    count = decoder_layer_count(model)
    if count is None:
        raise UserError("peft.last_layers: this model's config does not say how many decoder layers it has "
                        "(num_hidden_layers)", hint="unset peft.last_layers")
    return list(trained_layer_indices(peft_cfg.last_layers, count))


def apply_method(model, peft_cfg: PeftSection, load_init_weights: bool = True):
    """peft.method applied to the loaded base. A new method is one more branch here (its rules in decisions).
    With peft.init_adapter the adapter built from the recipe is checked against that adapter's config and takes
    its weights (unless `load_init_weights` is off: --smoke's shrunken model has other shapes)."""
    from peft import IA3Config, LoraConfig, get_peft_model

    from gpupoor.quiet import bitsandbytes_unless_loaded

    layers = last_layer_indices(model, peft_cfg)
    if peft_cfg.method == "full":
        _refuse_full_with_adapter(peft_cfg)
        return select_trainable(model, peft_cfg, layers)
    where = {"layers_to_transform": layers, "layers_pattern": "layers"} if layers is not None else {}
    saved = {"modules_to_save": peft_cfg.modules_to_save or None, "task_type": "CAUSAL_LM"}
    targets = peft_cfg.target_modules
    if layers is not None and targets == "all-linear" and peft_cfg.method != "ia3":
        targets = decoder_linear_names(model)  # peft takes layers_to_transform with a list of names only
    if peft_cfg.method == "ia3":
        # `all-linear` means peft's IA3 defaults for the architecture (Llama: attention k/v, the MLP's down proj).
        scaled, feedforward = ia3_modules(getattr(model.config, "model_type", "llama"), peft_cfg.target_modules)
        if layers is not None:  # IA3Config has no layers_to_transform: name those layers' modules in full
            scaled = [name for name, _ in model.named_modules()
                      if name.rsplit(".", 1)[-1] in scaled and _layer_of(name) in layers]
            feedforward = [name for name in scaled if name.rsplit(".", 1)[-1] in feedforward]
        config = IA3Config(target_modules=list(scaled), feedforward_modules=list(feedforward), **saved)
    else:
        config = LoraConfig(r=peft_cfg.rank, lora_alpha=peft_cfg.effective_alpha, lora_dropout=peft_cfg.dropout,
                            target_modules=targets, use_dora=peft_cfg.method == "dora",
                            **where, **saved)
    try:
        with bitsandbytes_unless_loaded():
            peft_model = get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"peft.target_modules: {exc}", hint="use module names of this model, or all-linear") from None
    if peft_cfg.init_adapter:
        start_from_adapter(peft_model, peft_cfg, load_init_weights)
    return peft_model


# ----------------------------------------------------------------------------------------------------------
# peft.init_adapter: start from an adapter's weights (continued training, a second stage)

INIT_ADAPTER_HINT = ("peft.init_adapter takes a run's final/ (or checkpoints/step-N), a run directory (its final/ "
                     "is used) or a PEFT adapter directory saved with safetensors")


@dataclass
class InitAdapter:
    path: Path  # the adapter directory (a run's final/, a checkpoint, or any PEFT adapter directory)
    config: dict  # its adapter_config.json


def find_init_adapter(value: str, base_dir: Path) -> InitAdapter:
    """The adapter `peft.init_adapter` names (relative to `base_dir`; a run dir means its final/), verified
    against its manifest when gpupoor wrote it, with its config read. Reads no weights."""
    from gpupoor.storage.checkpoint import ADAPTER, ADAPTER_CONFIG, verify_adapter_dir
    from gpupoor.storage.rundir import is_run_dir

    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    # merge.resolve_adapter does this for merge-lora, but merge imports this module (a cycle): the same two
    # steps, run dir -> final/ and the manifest check, with errors that speak of peft.init_adapter.
    in_run = is_run_dir(path)
    adapter = path / "final" if in_run else path
    if adapter.exists() and not adapter.is_dir():
        raise UserError(f"peft.init_adapter: {adapter} is a file; expected an adapter directory "
                        "(adapter_config.json and adapter_model.safetensors)", hint=INIT_ADAPTER_HINT)
    if not adapter.is_dir():
        hint = (f"name one of its checkpoints ({path}/checkpoints/step-N) or finish it first (gpupoor resume {path})"
                if in_run else INIT_ADAPTER_HINT)
        raise UserError(f"peft.init_adapter: {adapter}: no such directory"
                        + (" (the run has not finished)" if in_run else ""), hint=hint)
    if not (adapter / ADAPTER_CONFIG).is_file():
        kind = ("a whole fine-tuned model (peft.method: full), not an adapter" if (adapter / "config.json").is_file()
                else f"no {ADAPTER_CONFIG}: not a PEFT adapter directory")
        raise UserError(f"peft.init_adapter: {adapter} holds {kind}", hint=INIT_ADAPTER_HINT)
    try:
        verify_adapter_dir(adapter, in_run=in_run)
    except UserError as exc:
        raise UserError(f"peft.init_adapter: {exc.message}",
                        hint="restore the file, or name another checkpoint of the run (RUN/checkpoints/step-N)"
                        ) from None
    if not (adapter / ADAPTER).is_file():
        # A .bin adapter is a pickle: loading one runs whatever code it holds.
        raise UserError(f"peft.init_adapter: {adapter} has no {ADAPTER}; gpupoor loads adapter weights only from "
                        "safetensors", hint="load it with peft once and save_pretrained(..., safe_serialization=True)")
    try:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise UserError(f"peft.init_adapter: {adapter / ADAPTER_CONFIG} is not readable: {exc}",
                        hint=INIT_ADAPTER_HINT) from None
    return InitAdapter(adapter, config)


def check_init_adapter(loaded) -> None:
    """For `gpupoor validate`: peft.init_adapter (relative to the recipe) exists, is intact and was trained with
    the recipe's method, rank, alpha, target modules and modules_to_save, so far as the recipe says them without
    the model (`all-linear` and `last_layers` are checked again when the model is built). Loads no weights; reads
    and hashes the adapter's files."""
    peft_cfg = loaded.recipe.peft
    if peft_cfg.init_adapter is None:
        return
    _refuse_full_with_adapter(peft_cfg)
    adapter = find_init_adapter(peft_cfg.init_adapter, loaded.base_dir)
    _raise_mismatches(adapter, _config_mismatches(peft_cfg, adapter.config))


def start_from_adapter(model, peft_cfg: PeftSection, load_weights: bool = True) -> None:
    """Check the adapter peft built from the recipe against peft.init_adapter's config, then load its weights in
    place of the fresh ones (QLoRA too: the adapter's tensors are plain, only the frozen base is quantized)."""
    adapter = find_init_adapter(peft_cfg.init_adapter, Path.cwd())  # absolute in a stored recipe
    built = model.peft_config["default"]
    layers = getattr(built, "layers_to_transform", None)  # IA3 names its layers' modules in full instead
    _raise_mismatches(adapter, _config_mismatches(peft_cfg, adapter.config, built.target_modules, layers))
    if load_weights:
        _load_adapter_weights(model, adapter)


def _refuse_full_with_adapter(peft_cfg: PeftSection) -> None:
    if peft_cfg.method == "full" and peft_cfg.init_adapter:
        raise UserError(f"peft.init_adapter = {peft_cfg.init_adapter!r}: peft.method full trains the model's own "
                        "weights and cannot start from an adapter",
                        hint="merge the adapter into the base (gpupoor merge-lora ADAPTER OUT) and set "
                        "model.name_or_path to OUT; or train with method lora, dora or ia3")


def adapter_method(config: dict) -> str:
    """The peft.method an adapter_config.json describes (or its peft_type, lower case, for another kind)."""
    kind = str(config.get("peft_type", "?")).lower()
    return "dora" if kind == "lora" and config.get("use_dora") else kind


def _leaves(targets) -> list[str] | None:
    """Module names as leaf names (`model.layers.1.mlp.up_proj` -> `up_proj`); None for a regex string."""
    if isinstance(targets, str):  # `all-linear` before peft resolves it, or a regex: compared when built
        return None
    return sorted({str(name).rsplit(".", 1)[-1] for name in targets or ()})


def _config_mismatches(peft_cfg: PeftSection, config: dict, built_targets=None,
                       built_layers=None) -> list[tuple[str, object, object]]:
    """(recipe key, the recipe's value, the adapter's) for each setting that differs. Without the built peft
    config (`built_targets`), only target lists the recipe spells out are compared."""
    method = adapter_method(config)
    if method != peft_cfg.method:
        return [("peft.method", peft_cfg.method, method)]  # the rest means something else in another method
    found = []
    if method in ("lora", "dora"):
        found += [("peft.rank", peft_cfg.rank, config.get("r")),
                  ("peft.alpha", peft_cfg.effective_alpha, config.get("lora_alpha"))]
        if built_targets is not None:
            found.append(("peft.last_layers", _layer_list(built_layers),
                          _layer_list(config.get("layers_to_transform"))))
    recipe_targets = _leaves(built_targets if built_targets is not None else peft_cfg.target_modules)
    adapter_targets = _leaves(config.get("target_modules"))
    if recipe_targets is not None and adapter_targets is not None:
        found.append(("peft.target_modules", recipe_targets, adapter_targets))
    found.append(("peft.modules_to_save", sorted(peft_cfg.modules_to_save),
                  sorted(config.get("modules_to_save") or [])))
    return [(key, ours, theirs) for key, ours, theirs in found if not _same(ours, theirs)]


def _layer_list(layers) -> str:
    if layers is None:
        return "every layer"
    return "layers " + ", ".join(str(i) for i in ([layers] if isinstance(layers, int) else sorted(layers)))


def _same(ours, theirs) -> bool:
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        return float(ours) == float(theirs)
    return ours == theirs


def _raise_mismatches(adapter: InitAdapter, mismatches: list[tuple[str, object, object]]) -> None:
    if not mismatches:
        return
    lines = "".join(f"\n    {key}: the recipe builds {_shown(ours)}, the adapter has {_shown(theirs)}"
                    for key, ours, theirs in mismatches)
    raise UserError(f"peft.init_adapter: {adapter.path} was trained with other settings than this recipe's:{lines}",
                    hint="set those keys to the adapter's values (see its adapter_config.json) to continue from it, "
                    "or unset peft.init_adapter to start from fresh weights")


def _shown(value) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def _load_adapter_weights(model, adapter: InitAdapter) -> None:
    """The adapter's tensors into the peft model's adapter (named `default`); every adapter tensor of the model
    must get one, and every tensor of the file must land somewhere."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from gpupoor.storage.checkpoint import ADAPTER

    try:
        state = load_file(adapter.path / ADAPTER)  # on the CPU: load_state_dict copies onto each parameter's device
    except Exception as exc:  # OSError, or safetensors' own error for a damaged file
        raise UserError(f"peft.init_adapter: cannot read {adapter.path / ADAPTER}: {exc}") from None
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    try:
        result = set_peft_model_state_dict(model, state, adapter_name="default")
    except RuntimeError as exc:  # a tensor of another shape: an adapter trained on another base model
        raise UserError(f"peft.init_adapter: {adapter.path}'s tensors do not fit this model: "
                        f"{str(exc).strip().splitlines()[-1].strip()}",
                        hint=f"train on the base it was trained on ({adapter.config.get('base_model_name_or_path')})"
                        ) from None
    missing = sorted(trainable & set(result.missing_keys))
    if missing or result.unexpected_keys:
        problem = (f"has no weights for {len(missing)} adapter tensors of this model (e.g. {missing[0]})" if missing
                   else f"holds tensors this model's adapter has no place for (e.g. {result.unexpected_keys[0]})")
        raise UserError(f"peft.init_adapter: {adapter.path} {problem}",
                        hint="it adapts other layers or modules than the recipe: set peft.target_modules, "
                        "peft.last_layers and peft.modules_to_save as it was trained")


def decoder_linear_names(model) -> list[str]:
    """The names of the linear layers inside the decoder layers (what `all-linear` adapts: not the head)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"})


def _layer_of(module_name: str) -> int | None:
    """The decoder layer index in a module name like `model.layers.3.mlp.down_proj`."""
    parts = module_name.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    return None


def select_trainable(model, peft_cfg: PeftSection, layers: list[int] | None):
    """`full`: the model's own weights train: every one, or those of the last layers and named modules."""
    chosen_modules = peft_cfg.modules_to_save
    everything = layers is None and not chosen_modules
    for param in model.parameters():
        param.requires_grad = everything
    for name, param in model.named_parameters():
        if layers is not None and _layer_of(name) in layers:
            param.requires_grad = True
    # By module, not by parameter name: a head tied to the embeddings lists its weight under the embedding's name.
    for name, module in model.named_modules():
        if any(_matches(name, wanted) for wanted in chosen_modules):
            for param in module.parameters():
                param.requires_grad = True
    return model


def _matches(module_name: str, wanted: str) -> bool:
    """peft's rule for a name in target_modules / modules_to_save: the whole name or its dotted tail."""
    return module_name == wanted or module_name.endswith("." + wanted)


def check_module_names(model, peft_cfg: PeftSection) -> None:
    """Names in peft.target_modules / peft.modules_to_save that match no module are an error, not a silent
    no-op (peft only complains when *no* target matches, and never about modules_to_save)."""
    names = [name for name, _ in model.named_modules() if name]
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names if not name.rsplit(".", 1)[-1].isdigit()})
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    keys = {"peft.target_modules": peft_cfg.target_modules if isinstance(peft_cfg.target_modules, list) else [],
            "peft.modules_to_save": peft_cfg.modules_to_save}
    for key, wanted in keys.items():
        unmatched = [w for w in wanted if not any(_matches(name, w) for name in names)]
        if unmatched:
            choices = linear if key == "peft.target_modules" else leaves
            raise UserError(f"{key}: {', '.join(map(repr, unmatched))} match no module of this model",
                            hint=f"its {'linear layers' if key == 'peft.target_modules' else 'modules'} are named: "
                            + ", ".join(choices))


def _prepare_quantized(model) -> None:
    """Freeze the quantized base and keep its small unquantized tensors (norms, biases) in fp32 for stable
    sums. peft's prepare_model_for_kbit_training casts *every* unquantized tensor to fp32, embeddings and
    output head included: 4.2 GB instead of 2.1 GB for Llama-3.1-8B's, on the card QLoRA is meant to save.
    Those stay in the compute dtype here (they are frozen; autocast computes in it anyway)."""
    for param in model.parameters():
        param.requires_grad = False
        if param.dtype in (torch.float16, torch.bfloat16) and param.ndim < 2:
            param.data = param.data.float()


def _requantize(model, quantization, dtype, device, common):
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, quantization_config=quantization,
                                                    device_map={"": device}, **common)


def summarize(model) -> ModelSummary:
    total = trainable = weight_bytes = 0
    for param in model.parameters():
        count = param.numel()
        # bitsandbytes packs two 4-bit values per uint8 element: count the logical parameters.
        if param.dtype == torch.uint8 and hasattr(param, "quant_state"):
            count *= 2
        total += count
        trainable += count if param.requires_grad else 0
        weight_bytes += param.numel() * param.element_size()
    return ModelSummary(total, trainable, weight_bytes)
