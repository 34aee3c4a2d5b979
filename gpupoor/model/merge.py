"""Merging a trained adapter into its base (the library behind `gpupoor merge-lora`, export and generate): a
standalone model directory from base + adapter (LoRA, DoRA or IA3), merged shard by shard; the checks that a base
is the one the adapter was trained for (`check_base_fits`); `verify_merge`. A GGUF base is dequantized once into a
temporary safetensors directory first (`_base_directory`).

Peak RAM is about one output shard plus the adapter, not the whole model: tensors are read one at a time from
the base's safetensors shards, each tensor the adapter targets is replaced by its merged form computed in fp32
(LoRA: W + B @ A * alpha / r; DoRA: that, rescaled per output row to the learned magnitude; IA3: W times the
learned scaling vector; see `AdapterWeights`), and output shards are written as they fill up. For QLoRA runs
the base is first put through the same 4-bit (or 8-bit) quantization the run trained against, so the merged
model reproduces the trained one.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gpupoor.decisions import evaluates_in_train_mode
from gpupoor import faults
from gpupoor.errors import UserError
from gpupoor.hardware import DTYPES
from gpupoor.method_table import METHODS, Method, method_of_adapter
from gpupoor.model.gguf import is_gguf
from gpupoor.model.identity import check_base_unchanged, config_facts
from gpupoor.storage.checkpoint import read_manifest
from gpupoor.storage.files import atomic_dir, writer_tag
from gpupoor.storage.run_weights import RunWeights
from gpupoor.storage.shards import ShardWriter, weight_files
from gpupoor.units import ProgressLine

PEFT_PREFIX = "base_model.model."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def base_files(base: str, revision: str | None = None) -> Path:
    """A directory with the base's config and safetensors weights: local, or downloaded from the hub."""
    local = Path(base).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"base model {local} has no config.json: it is not a model directory saved with "
                            "save_pretrained", hint="pass --base with the model directory (or hub id) the run trained on")
        return local
    from huggingface_hub import snapshot_download

    try:
        # model*.safetensors: the transformers shards, not other formats some repos ship beside them
        return Path(snapshot_download(base, revision=revision, allow_patterns=[
            "*.json", "model*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:
        raise UserError(f"base model {base!r}: not a local directory and not downloadable: {exc}",
                        hint="pass --base with a local directory of the base model") from None


# The decoder layer a tensor name belongs to (model.layers.3..., transformer.h.3..., blocks.3...).
LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


def base_config(base: str, revision: str | None = None) -> dict | None:
    """The config.json of a base (a local directory, or a hub id's cached or downloadable config), or None when
    it cannot be read here (loading the base then says why)."""
    local = Path(base).expanduser()
    try:
        if is_gguf(base) and local.is_file():  # its metadata: the tensors are not read
            from gpupoor.model.gguf import read_gguf

            return dict(read_gguf(local).config)
        if local.is_dir():
            return json.loads((local / "config.json").read_text())
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(base, "config.json", revision=revision)).read_text())
    except Exception:  # no config, no network, not a repo: the load that follows names the problem
        return None


def _trained_facts(adapter_dir: Path, adapter_config: dict) -> dict | None:
    """The facts of the model the adapter was trained on: as the run recorded them (manifest "models"), else from
    the base it names when that is a local directory."""
    recorded = read_manifest(adapter_dir).get("models", {}).get("model.name_or_path", {}).get("config")
    if isinstance(recorded, dict):
        return recorded
    named = adapter_config.get("base_model_name_or_path")
    config = base_config(named) if named and Path(named).expanduser().is_dir() else None
    return config_facts(config) if config is not None else None


def check_base_fits(adapter_dir: Path, base: dict | None, base_name: str) -> None:
    """Refuse a base the adapter was not trained for, before it is loaded: another architecture, depth or width
    than the run trained on, or decoder layers the adapter has weights for but the base lacks, or that the base
    has beyond those the adapter covers (peft would apply part of the adapter, silently). merge-lora and generate
    --base both ask."""
    from safetensors import safe_open

    if base is None:
        return
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    ours, theirs = config_facts(base), _trained_facts(adapter_dir, adapter_config)
    problems = []
    if theirs and None not in (theirs["model_type"], ours["model_type"]) and theirs["model_type"] != ours["model_type"]:
        problems.append(f"it was trained on another architecture ({theirs['model_type']}; the base is "
                        f"{ours['model_type']})")
    depth = ours["num_hidden_layers"]
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as handle:
        layers = {int(match.group(1)) for key in handle.keys() if (match := LAYER_INDEX.search(key))}
    targets = adapter_config.get("target_modules")
    # Generic module names on every layer (not a regex, not named layer by layer, no layers_to_transform): the
    # adapter's highest layer is the trained model's last.
    every_layer = adapter_config.get("layers_to_transform") is None and (targets == "all-linear" or (
        isinstance(targets, list) and not any(LAYER_INDEX.search(f".{name}.") for name in targets)))
    trained_depth = theirs["num_hidden_layers"] if theirs and theirs["num_hidden_layers"] else \
        max(layers) + 1 if layers and every_layer else None
    if layers and depth is not None and max(layers) >= depth:
        problems.append(f"it was trained on another model (it has weights for decoder layer {max(layers)}; the base "
                        f"has {depth} decoder layer{'s' if depth != 1 else ''})")
    elif None not in (trained_depth, depth) and trained_depth != depth:
        unadapted = f": layers {trained_depth}-{depth - 1} would run without it" if depth > trained_depth else ""
        problems.append(f"it was trained on another model ({trained_depth} decoder layers; the base has "
                        f"{depth}{unadapted})")
    width = theirs["hidden_size"] if theirs else None
    if None not in (width, ours["hidden_size"]) and width != ours["hidden_size"]:
        problems.append(f"it was trained on another model (hidden size {width}; the base's is {ours['hidden_size']})")
    if problems:
        raise UserError(f"the adapter in {adapter_dir} does not fit the base {base_name}: {problems[0]}",
                        hint="pass --base with the model the run trained on, or leave --base out")


class ShapeMismatch(ValueError):
    """An adapter tensor that does not fit the base weight it targets (the adapter was trained on another model)."""

    def __init__(self, what: str, theirs: tuple, ours: tuple):
        super().__init__(what)
        self.what, self.theirs, self.ours = what, theirs, ours


def _oriented(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """The weight as (out, in): GPT-2's Conv1D stores it (in, out) (peft's fan_in_fan_out)."""
    return weight.T if fan_in_fan_out else weight


class AdapterWeights:
    """A peft adapter read once: per base tensor name, how the merge changes it, and what it replaces outright
    (modules_to_save). `updates[name](old_fp32) -> new_fp32`; `required`: the names the base must have.

    - LoRA: W + s * B @ A, s = alpha / r (alpha / sqrt(r) with rslora; alpha_pattern per module).
    - DoRA (LoRA with use_dora): (m / ||W + s * B @ A||_row) * (W + s * B @ A), the norm of each output row
      over the input dimension in fp32 (peft's DoraLinearLayer.get_weight_norm); m is `lora_magnitude_vector`.
    - IA3: W * l, l = `ia3_l` of shape (out, 1) (scales outputs; the bias too) or, for `feedforward_modules`,
      (1, in) (scales inputs).
    """

    def __init__(self, adapter_dir: Path):
        from safetensors.torch import load_file

        self.config = json.loads((adapter_dir / "adapter_config.json").read_text())
        method = method_of_adapter(self.config)
        if method is None or not method.merges:
            *others, last = [m.title for m in METHODS.values() if m.merges]
            mergeable = f"{', '.join(others)} and {last}" if others else last
            raise UserError(f"{adapter_dir}: only {mergeable} adapters can be merged (this is "
                            f"{self.config.get('peft_type')})")
        self.method, self.kind = method, method.title
        self.fan_in_fan_out = bool(self.config.get("fan_in_fan_out"))
        # role -> the saved tensor's name after the module's (peft drops the adapter name when saving)
        roles = dict(method.saved_tensors)
        patterns = {role: rf"(.+)\.{re.escape(suffix)}" + ("(?:\\.weight)?" if role == "m" else "")
                    for role, suffix in roles.items()}
        parts: dict[str, dict[str, torch.Tensor]] = {}  # module name -> its adapter tensors by role
        self.replacements: dict[str, torch.Tensor] = {}
        for key, tensor in load_file(adapter_dir / "adapter_model.safetensors").items():
            name = key.removeprefix(PEFT_PREFIX)
            for role, pattern in patterns.items():
                match = re.fullmatch(pattern, name)
                if match:
                    parts.setdefault(match.group(1), {})[role] = tensor
                    break
            else:
                if ".lora_" in name or ".ia3_" in name:
                    raise UserError(f"{adapter_dir}: unsupported adapter tensor {key} for a {self.kind} merge "
                                    "(an adapter on embeddings or biases, or of another kind)")
                self.replacements[name] = tensor  # modules_to_save: trained in full
        self.updates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.required: set[str] = set()
        for module, tensors in parts.items():
            missing = [suffix for role, suffix in roles.items() if role not in tensors]
            if missing:
                raise UserError(f"{adapter_dir}: the adapter is incomplete: {module} has no {', '.join(missing)}")
            self.required.add(f"{module}.weight")
            if method.scaling_vector:
                feedforward = self._feedforward(module)
                self.updates[f"{module}.weight"] = self._ia3(module, tensors["l"], feedforward)
                if not feedforward:  # peft scales an output-scaled module's bias too (when it has one)
                    self.updates[f"{module}.bias"] = self._ia3_bias(module, tensors["l"])
            else:
                self.updates[f"{module}.weight"] = self._lora(module, tensors)

    def scale(self, module: str, rank: int) -> float:
        alpha = self.config["lora_alpha"]
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.search(rf"(^|\.){pattern}$", module):
                alpha = value
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def _feedforward(self, module: str) -> bool:
        """peft's rule (IA3Model._check_target_module_feedforward): a regex matched in full, or a name suffix."""
        modules = self.config.get("feedforward_modules") or []
        if isinstance(modules, str):
            return bool(re.fullmatch(modules, module))
        return any(module.endswith(suffix) for suffix in modules)

    def _lora(self, module: str, tensors: dict[str, torch.Tensor]):
        def new_weight(weight: torch.Tensor) -> torch.Tensor:
            a, b = tensors["A"].float(), tensors["B"].float()
            delta = (b @ a) * self.scale(module, a.shape[0])  # (out, in)
            weight = _oriented(weight, self.fan_in_fan_out)
            if delta.shape != weight.shape:
                raise ShapeMismatch(f"update for {module}.weight", tuple(_oriented(delta, self.fan_in_fan_out).shape),
                                    tuple(_oriented(weight, self.fan_in_fan_out).shape))
            merged = weight + delta
            if self.method.magnitude:
                magnitude = tensors["m"].float().flatten()
                if magnitude.shape[0] != merged.shape[0]:
                    raise ShapeMismatch(f"magnitude of {module}", tuple(magnitude.shape), (merged.shape[0],))
                merged = merged * (magnitude / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
            return _oriented(merged, self.fan_in_fan_out)

        return new_weight

    def _ia3(self, module: str, vector: torch.Tensor, feedforward: bool):
        def new_weight(weight: torch.Tensor) -> torch.Tensor:
            out, inputs = _oriented(weight, self.fan_in_fan_out).shape
            expected = (1, inputs) if feedforward else (out, 1)
            if tuple(vector.shape) != expected:
                raise ShapeMismatch(f"scaling of {module}", tuple(vector.shape), expected)
            return weight * _oriented(vector.float(), self.fan_in_fan_out)

        return new_weight

    def _ia3_bias(self, module: str, vector: torch.Tensor):
        def new_bias(bias: torch.Tensor) -> torch.Tensor:
            if vector.numel() != bias.numel():
                raise ShapeMismatch(f"scaling of {module}", tuple(vector.shape), (bias.numel(), 1))
            return bias * vector.float().reshape(bias.shape)

        return new_bias


def quantized_modules(config, quantization: dict) -> set[str]:
    """Weight names transformers quantizes with bitsandbytes for this architecture: every nn.Linear except
    the output embedding and tied/last modules (transformers' own rule, applied to a weightless model)."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = set(get_keys_to_not_convert(model)) | set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not any(name == s or name.endswith("." + s) for s in skip)}


def _explicit_precision(recipe: dict, qlora_original: str) -> str:
    precision = recipe.get("precision", "auto")
    if precision == "auto":
        raise UserError("the adapter's run does not record which precision `auto` resolved to",
                        hint=f"merge into the full-precision base ({qlora_original}), or use an adapter written "
                        "by this gpupoor version")
    return precision


def quantize_roundtrip(weight: torch.Tensor, quantization: dict, load_dtype: torch.dtype) -> torch.Tensor:
    """What a bitsandbytes layer computes with: the weight quantized as at load time, then dequantized."""
    import bitsandbytes.functional as bnbf

    weight = weight.to(load_dtype)
    if quantization["bits"] == 4:
        packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=quantization["double_quant"],
                                           quant_type=quantization["quant_type"])
        return bnbf.dequantize_4bit(packed, state).float()
    codes, row_stats, _ = bnbf.int8_vectorwise_quant(weight.to(torch.float16))
    return bnbf.int8_vectorwise_dequant(codes, row_stats).float()


def _run_recipe(run_dir: Path | None) -> dict:
    """The recipe (as a dict) of the run that trained the adapter, when known."""
    if run_dir is None:
        return {}
    from gpupoor.storage.rundir import stored_recipe

    return stored_recipe(run_dir).model_dump(mode="json")


def model_card(base: str, recipe: dict, metrics: dict, dtype: str, qlora_base: str | None,
               method: Method = METHODS["lora"]) -> str:
    from gpupoor.storage.model_card import card_text

    kind, low_rank = method.title, method.low_rank

    lines = [f"# {kind} fine-tune of {base}, merged", "",
             f"Base model `{base}` with a {kind} adapter trained by gpupoor merged into its weights ({dtype}). "
             "Load it with `AutoModelForCausalLM.from_pretrained` of this directory; gpupoor is not needed.", ""]
    if qlora_base:
        lines += [f"The adapter was trained on a {recipe.get('quantization', {}).get('bits')}-bit base (QLoRA); "
                  + ("it was merged into the dequantized quantized base, which reproduces the trained model."
                     if qlora_base == "dequantized" else "it was merged into the original full-precision base."), ""]
    if recipe:
        data, peft, training = recipe.get("data", {}), recipe.get("peft", {}), recipe.get("training", {})
        lines += ["## Training recipe", "", "| setting | value |", "|---|---|",
                  f"| data | `{data.get('path')}` ({data.get('format')}, max_length {data.get('max_length')}) |",
                  f"| {kind} | targets {peft.get('target_modules')} |" if not low_rank else
                  f"| {kind} | rank {peft.get('rank')}, alpha {peft.get('alpha') or 2 * (peft.get('rank') or 0)}, "
                  f"targets {peft.get('target_modules')} |",
                  f"| precision | {recipe.get('precision')} |",
                  f"| quantization | {recipe.get('quantization', {}).get('bits') or 'none'} |",
                  f"| batch | {training.get('micro_batch_size')} x {training.get('gradient_accumulation_steps')} "
                  "accumulation |",
                  f"| learning rate | {training.get('learning_rate')} ({training.get('lr_scheduler')}) |", ""]
    if metrics:
        lines += ["## Final metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
                  for key, value in metrics.items()] + [""]
    return card_text(base, "transformers", [kind.lower(), "merged"], "\n".join(lines))


@dataclass
class MergePlan:
    """What the merge reads and how it changes each base tensor."""

    base_name: str
    base_dir: Path
    adapter: AdapterWeights
    target_dtype: torch.dtype
    quantization: dict  # the run's quantization section ({} when not quantized)
    quantize: set[str]  # weight names put through the run's quantization first (QLoRA, dequantized base)
    load_dtype: torch.dtype | None  # the dtype the base was loaded in before quantizing

    def wrong_model(self, what: str, theirs: tuple, ours: tuple) -> UserError:
        return UserError(f"the adapter's {what} has shape {theirs} but the base {self.base_name} has {ours}: it was "
                         "trained on another model", hint="pass --base with the model the run trained on")


def merge_lora(source: RunWeights, output: Path, *, dtype: str = "auto", base: str | None = None,
               max_shard_bytes: int = 2 * 10**9, qlora_base: str = "dequantized", say=print, force: bool = False,
               check_base: bool = True, qlora_original: str = "--qlora-base original",
               metrics: dict | None = None) -> Path:
    """Merge a LoRA, DoRA or IA3 adapter into its base (a model directory, a hub id or a GGUF file): a new
    standard model directory at `output`. The base is first checked to be the one the run trained on (its
    manifest's record; `force` goes on with a warning; `check_base` off: the caller checked it).
    `qlora_original`: how the caller's user merges a QLoRA adapter into the full-precision base instead.
    `metrics`: the run's last metrics, for the model card.
    SIGTERM and SIGHUP stop it like Ctrl-C, removing the partial output; what a merge into the same output that
    was killed left beside it is removed first."""
    from gpupoor.errors import termination_raised
    from gpupoor.storage.rundir import check_writable

    output = output.expanduser().resolve()
    if output.exists():
        raise UserError(f"output directory {output} already exists", hint="choose a new --output, or delete it")
    check_writable(output)  # before the base is read: an impossible --output is said at once
    _sweep_killed_merges(output, say)
    adapter = AdapterWeights(source.path)
    base_name = base or adapter.config.get("base_model_name_or_path")
    if not base_name:
        raise UserError("the adapter does not name its base model", hint="pass --base MODEL")
    if check_base:
        check_base_unchanged(source.path, base, force, lambda text: say(f"warning: {text}"), "the merged model")
    # The hub revision the run trained on (recorded in the adapter config), unless another base was given.
    with termination_raised(), \
            _base_directory(base_name, None if base else adapter.config.get("revision"), source, output) as base_dir:
        _merge_from(base_dir, base_name, adapter, source, output, dtype, max_shard_bytes, qlora_base, say,
                    qlora_original, metrics or {})
    return output


def _sweep_killed_merges(output: Path, say) -> None:
    """Remove what a merge into `output` that was killed on this machine (its process gone) left beside it: the
    partial output (atomic_dir's `.tmp-NAME-PID@HOST`) and a GGUF base's dequantized copy
    (`.tmp-gguf-base-PID@HOST-*`); name those it leaves alone."""
    from gpupoor.storage.files import WRITER, sweep_leftovers

    for pattern in (re.compile(rf"\.tmp-{re.escape(output.name)}-{WRITER}"),
                    re.compile(rf"\.tmp-gguf-base-{WRITER}-[a-z0-9_]+")):
        removed, kept = sweep_leftovers(output.parent, pattern)
        for entry, _ in removed:
            say(f"removed {entry}, left by a merge that was killed")
        for entry, why in kept:
            say(f"note: {entry} looks like a merge's temporary folder, left alone: {why}")


def scratch_prefix(verb: str) -> str:
    """The start of the name of a scratch folder `verb` merges into (+ PID@HOST + "-" + a random tail)."""
    return f".gpupoor-{verb}-"


@contextlib.contextmanager
def merge_scratch(verb: str, parent: Path | None):
    """The folder a verb that merges for its own use (export, serve) works in, removed on the way out (an error,
    Ctrl-C, and SIGTERM/SIGHUP, which those verbs raise as exceptions). Its name carries this process (PID@HOST),
    so that the next one's `sweep_merge_scratch` tells a killed process's folder from a running one's. `parent`:
    where (None: the system's temporary directory)."""
    with tempfile.TemporaryDirectory(prefix=f"{scratch_prefix(verb)}{writer_tag()}-", dir=parent) as scratch:
        yield Path(scratch)


def sweep_merge_scratch(folder: Path, verb: str) -> tuple[list[tuple[Path, int]], list[tuple[Path, str]]]:
    """Remove the scratch folders (`merge_scratch`) that `verb`'s processes killed on this machine (SIGKILL, the
    OOM killer) left in `folder`. Returns storage.files.sweep_leftovers' (removed with sizes, kept with why)."""
    from gpupoor.storage.files import WRITER, sweep_leftovers

    return sweep_leftovers(folder, re.compile(rf"{re.escape(scratch_prefix(verb))}{WRITER}-[a-z0-9_]+"))


@contextlib.contextmanager
def _base_directory(base_name: str, revision: str | None, source: RunWeights, output: Path):
    """The base as a directory of safetensors shards the merge streams: itself, a hub snapshot, or for a GGUF
    base, the GGUF dequantized once into a temporary directory beside the output (removed after), in the dtype
    the run loaded it in. That loads the whole base (transformers' GGUF loader dequantizes every tensor in memory
    anyway); the merge then streams it like any other."""
    if not is_gguf(base_name):
        yield base_files(base_name, revision)
        return
    from gpupoor.model.load import save_dequantized

    dtype = DTYPES[read_manifest(source.path).get("precision") or "fp32"]
    output.parent.mkdir(parents=True, exist_ok=True)  # (the output's own atomic_dir would make it too)
    with tempfile.TemporaryDirectory(prefix=f".tmp-gguf-base-{writer_tag()}-", dir=output.parent) as tmp:
        yield save_dequantized(base_name, Path(tmp), dtype)


def _merge_from(base_dir: Path, base_name: str, adapter: AdapterWeights, source: RunWeights, output: Path,
                dtype: str, max_shard_bytes: int, qlora_base: str, say, qlora_original: str, metrics: dict) -> None:
    from transformers import AutoConfig

    check_base_fits(source.path, base_config(str(base_dir)), base_name)
    config = AutoConfig.from_pretrained(base_dir)
    recipe = _run_recipe(source.run_dir)
    quantization = dict(recipe.get("quantization") or {})
    base_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    base_dtype = getattr(torch, base_dtype) if isinstance(base_dtype, str) else base_dtype
    quantize, load_dtype = set(), None
    if quantization.get("bits") and qlora_base == "dequantized":
        quantize = quantized_modules(config, quantization)
        # The dtype the base was loaded in before quantizing: the run's resolved precision (in the manifest).
        load_dtype = DTYPES[read_manifest(source.path).get("precision") or _explicit_precision(recipe, qlora_original)]
        say(f"QLoRA run: merging into the base as the run saw it ({quantization['bits']}-bit, dequantized); "
            f"to merge into the full-precision weights instead: {qlora_original}")
    plan = MergePlan(base_name, base_dir, adapter, base_dtype if dtype == "auto" else DTYPES[dtype], quantization,
                     quantize, load_dtype)
    with atomic_dir(output, f".tmp-{output.name}-{writer_tag()}") as tmp:  # the output appears whole or not at all
        untied = _write_merged_weights(plan, tmp, max_shard_bytes, say)
        _write_model_files(plan, tmp, config, untied, source, recipe, metrics, qlora_base)


def _write_merged_weights(plan: MergePlan, out_dir: Path, max_shard_bytes: int, say=print) -> bool:
    """Stream the base's tensors, merge the adapter into those it targets (in fp32, then cast once), write shards.
    Returns whether a trained head had to be untied from the embeddings."""
    from safetensors import safe_open

    adapter = plan.adapter
    pending_update, pending_replace = set(adapter.required), set(adapter.replacements)
    writer = ShardWriter(out_dir, max_shard_bytes)
    shards = weight_files(plan.base_dir)
    total = 0
    for shard in shards:
        with safe_open(shard, framework="pt") as handle:
            total += len(handle.keys())
    progress = ProgressLine(total, say, "merging", "tensors")
    for shard in shards:
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                progress.tick()
                tensor = handle.get_tensor(name)
                if name in pending_replace:
                    if adapter.replacements[name].shape != tensor.shape:
                        raise plan.wrong_model(name, tuple(adapter.replacements[name].shape), tuple(tensor.shape))
                    tensor = adapter.replacements[name]
                    pending_replace.discard(name)
                elif tensor.is_floating_point() and name in plan.quantize:
                    tensor = quantize_roundtrip(tensor, plan.quantization, plan.load_dtype)
                elif tensor.is_floating_point() and plan.load_dtype is not None:
                    # The rest of the base as the run saw it too: a bf16 run loaded its embeddings, norms and head
                    # in bf16 (a no-op for an fp32 run).
                    tensor = tensor.to(plan.load_dtype)
                if name in adapter.updates:
                    try:
                        tensor = adapter.updates[name](tensor.float())
                    except ShapeMismatch as exc:
                        raise plan.wrong_model(exc.what, exc.theirs, exc.ours) from None
                    pending_update.discard(name)
                writer.add(name, tensor.to(plan.target_dtype) if tensor.is_floating_point() else tensor)
                faults.at_stage("working")  # tests: a signal once the output is begun
    if pending_update:
        raise UserError(f"the adapter targets weights the base {plan.base_name} does not have, e.g. "
                        f"{sorted(pending_update)[0]}: it was trained on another architecture",
                        hint="pass --base with the model the run trained on")
    for name in sorted(pending_replace):
        # A tied output head trained in full (modules_to_save: [lm_head]) is not in the base's files:
        # write it and untie, or loading would tie it back to the embeddings.
        writer.add(name, adapter.replacements[name].to(plan.target_dtype))
    writer.close()
    return bool(pending_replace)


def _write_model_files(plan: MergePlan, out_dir: Path, config, untied: bool, source: RunWeights, recipe: dict,
                       metrics: dict, qlora_base: str) -> None:
    """config.json, generation_config.json, the tokenizer and a model card beside the merged weights."""
    from transformers import GenerationConfig

    if untied:
        config.tie_word_embeddings = False
    config.dtype = plan.target_dtype
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    if (plan.base_dir / "generation_config.json").is_file():
        shutil.copy(plan.base_dir / "generation_config.json", out_dir / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer_source = source.path if (source.path / "tokenizer_config.json").is_file() else plan.base_dir
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, out_dir / name)
    (out_dir / "README.md").write_text(model_card(plan.base_name, recipe, metrics,
                                                  str(plan.target_dtype).removeprefix("torch."),
                                                  qlora_base if plan.quantization.get("bits") else None,
                                                  plan.adapter.method))


def verify_merge(source: RunWeights, merged: Path, base: str | None = None) -> float:
    """Max absolute logit difference between the merged model and base + adapter as trained (probe batch)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpupoor.model.load import quantization_config
    from gpupoor.quiet import bitsandbytes_unless_loaded
    from gpupoor.recipe.schema import QuantizationSection

    recipe = _run_recipe(source.run_dir)
    adapter = PeftConfig.from_pretrained(source.path)  # LoraConfig (LoRA, DoRA) or IA3Config
    if hasattr(adapter, "lora_dropout"):
        adapter.lora_dropout = 0.0  # the trained model runs in train mode below (see the 4-bit note): no dropout
    base_name = base or adapter.base_model_name_or_path
    quant = QuantizationSection(**(recipe.get("quantization") or {}))
    # A quantized base is loaded in the dtype the run loaded it in: bitsandbytes quantizes what it is given, and a
    # bf16 run's weights, rounded to bf16 first, get other 4-bit codes (1% of them on the tiny test model) than fp32
    # ones. Then everything computes in fp32, as the merged model does, so bf16's rounding of the activations
    # (~1e-2 of the logits) is not mistaken for the merge's error. What is left of a bf16 run's gap (~1e-3 of the
    # logits on the tiny model) is bitsandbytes dequantizing the 4-bit weights straight to fp32 here where the run
    # rounded them to bf16 (as the merge does).
    precision = read_manifest(source.path).get("precision", "fp32")
    load_dtype = DTYPES[precision] if quant.bits else torch.float32
    quantization = quantization_config(quant.model_copy(update={"compute_dtype": "fp32"}), precision) \
        if quant.bits else None
    if is_gguf(base_name):
        from gpupoor.model.load import load_gguf_model

        trained = load_gguf_model(base_name, load_dtype, quantization=quantization)
    else:
        trained = AutoModelForCausalLM.from_pretrained(base_name, dtype=load_dtype,
                                                       quantization_config=quantization,
                                                       revision=None if base else adapter.revision,
                                                       device_map={"": "cpu"} if quantization else None)
    for param in trained.parameters():  # the unquantized tensors (embeddings, norms, head), as the run saw them
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
    with bitsandbytes_unless_loaded():
        trained = PeftModel.from_pretrained(trained, source.path, config=adapter)
    merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    probe = tokenizer(["The quick brown fox jumps over the lazy dog.", "Below is an instruction"],
                      return_tensors="pt", padding=True)
    with torch.no_grad():
        # The trained model is loaded on the CPU: quantized, it runs in train mode (gpupoor.decisions says why).
        trained.train(evaluates_in_train_mode(quant.bits, "cpu"))
        merged_model.eval()
        reference = trained(**probe).logits
        logits = merged_model(**probe).logits
    mask = probe["attention_mask"].bool()
    return float((reference - logits).abs()[mask].max())
