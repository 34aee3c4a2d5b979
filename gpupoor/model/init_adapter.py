"""peft.init_adapter: start from an adapter's weights (continued training, a second stage). The adapter is found
(a run directory means its final/) and verified through gpupoor.storage.run_weights, checked against the recipe's
method, rank, alpha and modules, and its tensors loaded in place of the fresh ones."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.method_table import ADAPTER_METHODS, METHODS, method_of_adapter
from gpupoor.recipe.schema import PeftSection
from gpupoor.storage.checkpoint import ADAPTER, ADAPTER_CONFIG
from gpupoor.storage.run_weights import named_weights


INIT_ADAPTER_HINT = ("peft.init_adapter takes a run's final/ (or checkpoints/step-N), a run directory (its final/ "
                     "is used) or a PEFT adapter directory saved with safetensors")


@dataclass
class InitAdapter:
    path: Path  # the adapter directory (a run's final/, a checkpoint, or any PEFT adapter directory)
    config: dict  # its adapter_config.json


def find_init_adapter(value: str, base_dir: Path) -> InitAdapter:
    """The adapter `peft.init_adapter` names (relative to `base_dir`; a run dir means its final/), verified
    against its manifest when gpupoor wrote it, with its config read. Reads no weights."""
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    # The run dir -> final/ and the manifest check of merge-lora and generate, with errors that speak of
    # peft.init_adapter (a path, not a --checkpoint name: any checkpoint directory may be named).
    weights = named_weights(path)
    adapter, in_run = weights.path, weights.run_dir is not None
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
        weights.verify()
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
    refuse_full_with_adapter(peft_cfg)
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


def refuse_full_with_adapter(peft_cfg: PeftSection) -> None:
    if not METHODS[peft_cfg.method].adapter and peft_cfg.init_adapter:
        raise UserError(f"peft.init_adapter = {peft_cfg.init_adapter!r}: peft.method full trains the model's own "
                        "weights and cannot start from an adapter",
                        hint="merge the adapter into the base (gpupoor merge-lora ADAPTER OUT) and set "
                        f"model.name_or_path to OUT; or train with method {ADAPTER_METHODS}")


def adapter_method(config: dict) -> str:
    """The peft.method an adapter_config.json describes (or its peft_type, lower case, for another kind)."""
    method = method_of_adapter(config)
    return method.name if method else str(config.get("peft_type", "?")).lower()


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
    if METHODS[method].low_rank:
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
