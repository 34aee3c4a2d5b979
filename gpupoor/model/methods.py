"""The training method applied to a loaded base: peft adapters (LoRA, DoRA, IA3) on a frozen base, or for `full`
the base's own chosen weights; `peft.last_layers` and the module names the recipe gives, checked against the
model. A new method is one more branch of `apply_method` (its rules in gpupoor.decisions)."""

from __future__ import annotations

import torch

from gpupoor.decisions import ia3_modules, trained_layer_indices
from gpupoor.errors import UserError
from gpupoor.method_table import METHODS
from gpupoor.model.init_adapter import refuse_full_with_adapter, start_from_adapter
from gpupoor.recipe.schema import PeftSection


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
    if not METHODS[peft_cfg.method].adapter:
        refuse_full_with_adapter(peft_cfg)
        return select_trainable(model, peft_cfg, layers)
    where = {"layers_to_transform": layers, "layers_pattern": "layers"} if layers is not None else {}
    saved = {"modules_to_save": peft_cfg.modules_to_save or None, "task_type": "CAUSAL_LM"}
    targets = peft_cfg.target_modules
    method = METHODS[peft_cfg.method]
    if layers is not None and targets == "all-linear" and not method.scaling_vector:
        targets = decoder_linear_names(model)  # peft takes layers_to_transform with a list of names only
    if method.peft_type == "IA3":
        # `all-linear` means peft's IA3 defaults for the architecture (Llama: attention k/v, the MLP's down proj).
        scaled, feedforward = ia3_modules(getattr(model.config, "model_type", "llama"), peft_cfg.target_modules)
        if layers is not None:  # IA3Config has no layers_to_transform: name those layers' modules in full
            scaled = [name for name, _ in model.named_modules()
                      if name.rsplit(".", 1)[-1] in scaled and _layer_of(name) in layers]
            feedforward = [name for name in scaled if name.rsplit(".", 1)[-1] in feedforward]
        config = IA3Config(target_modules=list(scaled), feedforward_modules=list(feedforward), **saved)
    else:
        config = LoraConfig(r=peft_cfg.rank, lora_alpha=peft_cfg.effective_alpha, lora_dropout=peft_cfg.dropout,
                            target_modules=targets, use_dora=method.magnitude,
                            **where, **saved)
    try:
        with bitsandbytes_unless_loaded():
            peft_model = get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"peft.target_modules: {exc}", hint="use module names of this model, or all-linear") from None
    if peft_cfg.init_adapter:
        start_from_adapter(peft_model, peft_cfg, load_init_weights)
    return peft_model


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
