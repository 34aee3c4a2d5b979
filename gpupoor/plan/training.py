"""What trains, resolved against the model's shape: the adapters, weights and norms of each decoder layer for a
recipe's `peft` section, as gpupoor.model.methods builds them."""

from __future__ import annotations

from dataclasses import dataclass

from gpupoor.decisions import ia3_modules, trained_layer_indices
from gpupoor.method_table import METHODS
from gpupoor.model.shape import LINEARS, QK_NORMS, SANDWICH_NORMS, Shape

# Where each sits in transformers' module tree, under model.layers.N.
MODULE_PATHS = {**{name: f"self_attn.{name}" for name in LINEARS[:4] + QK_NORMS},
                **{name: f"mlp.{name}" for name in LINEARS[4:]}, **{name: name for name in SANDWICH_NORMS}}


@dataclass(frozen=True)
class LayerTraining:
    """What trains in one decoder layer: the linears carrying adapters (LoRA, DoRA, IA3), the linears and norms
    whose own weights train (`full`, or modules_to_save)."""

    adapters: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()

    @property
    def trains(self) -> bool:
        return bool(self.adapters or self.weights or self.norms)


@dataclass(frozen=True)
class Training:
    """What trains, resolved against the model's shape (peft.method, last_layers, target_modules, modules_to_save)."""

    method: str  # lora | dora | ia3 | full
    layers: tuple[LayerTraining, ...]  # one per decoder layer
    params: int  # trainable parameters
    embedding: bool  # the input embedding (or peft's copy of it) trains: gradients reach the first layer
    head: bool  # the output head (or peft's copy of it) trains
    scope: str  # where it trains, in words: "every layer", "the last 2 of 24 layers + lm_head", "all"
    feedforward: tuple[str, ...] = ()  # ia3: the modules scaled on their input
    final_norm: bool = False  # the norm after the last layer (or peft's copy of it) trains

    @property
    def first_active_layer(self) -> int:
        """The lowest decoder layer that keeps activations for backward: nothing below it needs a gradient."""
        if self.embedding:
            return 0
        return next((j for j, layer in enumerate(self.layers) if layer.trains), len(self.layers))


def _named(module: str, wanted: str) -> bool:
    """peft's rule for a module name in modules_to_save (and gpupoor's for `full`): the whole name, its dotted
    tail, or a dotted part of it (`mlp` names every layer's MLP, `layers.3` one layer)."""
    return f".{wanted}." in f".{module}."


def module_table(shape: Shape) -> list[tuple[str, int, str]]:
    """The base model's modules that hold parameters, named as transformers names them in the Llama family:
    (module, parameters, tensor). `tensor` names the storage: a tied head shares the embedding's."""
    table = [("model.embed_tokens", shape.embedding_params, "embedding")]
    for j in range(shape.layers):
        table += [(f"model.layers.{j}.{MODULE_PATHS[name]}", shape.linear_params(name), f"{j}.{name}")
                  for name in LINEARS]
        table += [(f"model.layers.{j}.{MODULE_PATHS[name]}", shape.norm_params(name), f"{j}.{name}")
                  for name in shape.norms]
    table += [("model.norm", shape.hidden, "norm"),
              ("lm_head", shape.embedding_params, "embedding" if shape.tied else "head")]
    return table


def resolve_training(shape: Shape, peft) -> Training:
    """What trains for a recipe's `peft` section on this model, as gpupoor.model.methods builds it: adapters on the
    targets of the trained layers plus peft's trained copies of modules_to_save, or for `full` the model's own
    tensors (all, or those of the last layers and the named modules)."""
    indices = trained_layer_indices(peft.last_layers, shape.layers)
    table = module_table(shape)
    saved = {(module, params, tensor) for module, params, tensor in table
             if any(_named(module, wanted) for wanted in peft.modules_to_save)}
    if not METHODS[peft.method].adapter:
        everything = peft.last_layers is None and not peft.modules_to_save
        prefixes = tuple(f"model.layers.{j}." for j in indices) if peft.last_layers is not None else ()
        trained = {tensor: params for module, params, tensor in table
                   if everything or module.startswith(prefixes) or (module, params, tensor) in saved}
        layers = tuple(LayerTraining(weights=tuple(n for n in LINEARS if f"{j}.{n}" in trained),
                                     norms=tuple(n for n in shape.norms if f"{j}.{n}" in trained))
                       for j in range(shape.layers))
        return Training(peft.method, layers, sum(trained.values()), "embedding" in trained,
                        ("embedding" if shape.tied else "head") in trained,
                        "all" if everything else _scope(peft, shape), final_norm="norm" in trained)
    feedforward: tuple[str, ...] = ()
    method = METHODS[peft.method]
    if method.scaling_vector:
        targets, feedforward = ia3_modules(shape.model_type, peft.target_modules)
        targets = tuple(name for name in LINEARS if name in targets)
    else:
        targets = tuple(LINEARS) if peft.target_modules == "all-linear" else \
            tuple(name for name in LINEARS if name in peft.target_modules)
    per_module = {name: method.adapter_params(peft.rank, *shape.linear(name), name in feedforward) for name in targets}
    in_layer = {module.split(".")[2] + "." + module.rsplit(".", 1)[1] for module, _, _ in saved
                if module.startswith("model.layers.")}
    layers = tuple(LayerTraining(adapters=targets if j in indices else (),
                                 weights=tuple(n for n in LINEARS if f"{j}.{n}" in in_layer),
                                 norms=tuple(n for n in shape.norms if f"{j}.{n}" in in_layer))
                   for j in range(shape.layers))
    params = len(indices) * sum(per_module.values()) + sum(params for _, params, _ in saved)  # peft's copies
    names = {module for module, _, _ in saved}
    # (peft trains a copy of a saved embedding; a tied head is then still read from the original.)
    head = "lm_head" in names or ("model.embed_tokens" in names and shape.tied)
    return Training(peft.method, layers, params, "model.embed_tokens" in names, head, _scope(peft, shape),
                    feedforward, final_norm="model.norm" in names)


def _scope(peft, shape: Shape) -> str:
    where = (f"the last {peft.last_layers} of {shape.layers} layers" if peft.last_layers is not None
             else "" if not METHODS[peft.method].adapter else "every layer")
    return " + ".join(filter(None, [where, *peft.modules_to_save]))
