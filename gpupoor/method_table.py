"""The training-method table: one entry per `peft.method`, read by the recipe's schema (the names and their docs),
its rules, the fused-path decision, the memory and time plans and the model builder. Torch-free, like the
optimizer table (gpupoor/optimizers.py).

A new PEFT method is one entry here plus its model code: the peft config gpupoor/model/methods.py builds for it
and, if it can be merged into the base, its arithmetic in gpupoor/model/merge.py (docs/architecture.md walks
through it). Its flags say which of the shapes the plan and the rules know it has: a low-rank update (rank,
alpha and dropout apply), a learned magnitude per output feature, or one learned scaling vector per module;
`adapter_params` is what one adapted linear trains."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """What a training method is, as every part that reads a recipe needs it."""

    name: str
    doc: str  # the recipe reference's line (peft.method)
    peft_type: str | None  # the adapter's peft type ("LORA", "IA3"); None: the model's own weights train
    low_rank: bool = False  # B @ A beside each adapted linear: peft.rank, alpha and dropout apply
    magnitude: bool = False  # a learned magnitude per output feature, the weight's row norm recomputed each step
    scaling_vector: bool = False  # one learned vector per module: over its input (feed-forward modules) or output
    fused: bool = False  # model.fused_layers' LoRA linears and gated MLP compute it
    title: str = ""  # how a model card and messages name it ("LoRA")
    # What peft saves per adapted module, by the role gpupoor.model.merge gives it: (role, the tensor name's suffix).
    # Empty: not merged into a base (merge-lora and export refuse it).
    saved_tensors: tuple[tuple[str, str], ...] = ()

    @property
    def merges(self) -> bool:
        """merge-lora and export can fold it into the base's weights."""
        return bool(self.saved_tensors)

    @property
    def adapter(self) -> bool:
        """A peft adapter beside the frozen base (not the base's own weights)."""
        return self.peft_type is not None

    def adapter_params(self, rank: int, fan_in: int, fan_out: int, feedforward: bool = False) -> int:
        """Parameters one adapted linear (fan_in -> fan_out) trains."""
        if self.scaling_vector:
            return fan_in if feedforward else fan_out
        if self.low_rank:
            return rank * (fan_in + fan_out) + (fan_out if self.magnitude else 0)
        return 0


METHODS: dict[str, Method] = {method.name: method for method in (
    Method("lora", "low-rank adapters (rank, alpha, dropout).", "LORA", low_rank=True, fused=True, title="LoRA",
           saved_tensors=(("A", "lora_A.weight"), ("B", "lora_B.weight"))),
    Method("dora", "LoRA with a learned magnitude per output (peft's use_dora; closer to full tuning; a per-step "
           "weight norm makes it slower).", "LORA", low_rank=True, magnitude=True, title="DoRA",
           saved_tensors=(("A", "lora_A.weight"), ("B", "lora_B.weight"), ("m", "lora_magnitude_vector"))),
    Method("ia3", "learned scales on attention keys/values and the MLP's down projection (far fewer parameters "
           "than LoRA).", "IA3", scaling_vector=True, title="IA3", saved_tensors=(("l", "ia3_l"),)),
    Method("full", "the model's own weights train (checkpoints and final/ hold the whole model; pair it with "
           "8-bit AdamW and gradient checkpointing on small hardware; no quantized base).", None,
           title="full fine-tuning"),
)}
METHOD_NAMES = tuple(METHODS)
_ADAPTERS = [method.name for method in METHODS.values() if method.adapter]
ADAPTER_METHODS = f"{', '.join(_ADAPTERS[:-1])} or {_ADAPTERS[-1]}"  # "lora, dora or ia3", for messages


def method_of_adapter(config: dict) -> Method | None:
    """The method an adapter_config.json describes: its peft_type, and for LoRA whether peft's use_dora is on;
    None for a peft type gpupoor does not train."""
    kinds = [method for method in METHODS.values() if method.adapter and method.peft_type == config.get("peft_type")]
    # use_dora is a LoraConfig key: another type's config carrying it is still that type
    return next((m for m in kinds if m.magnitude == bool(config.get("use_dora"))), kinds[0] if kinds else None)
