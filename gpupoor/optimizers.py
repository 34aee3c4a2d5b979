"""The optimizers a recipe may name (`training.optimizer`), one entry each: how training builds it, the state it
keeps per trained parameter (the plan's optimizer term), whether FSDP2 can step it, whether it needs bitsandbytes,
and its line in docs/recipe.md. A new optimizer is one entry here.

Read by the recipe schema (the allowed names, their documentation, the fsdp check), gpupoor.train.optim (the
builder), gpupoor.decisions (the bitsandbytes family) and the plan (the state bytes, the 8-bit alternative).
Imports nothing, torch included: the schema and `plan` stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Optimizer:
    build: str  # "module:Class", imported only when training builds it
    settings: tuple[str, ...]  # the training keys it is built with (gpupoor.train.optim names their arguments)
    state_bytes: float  # optimizer state per trained parameter, once the first step has created it
    state: str  # that state in words (the plan's optimizer line)
    doc: str  # its sentence in docs/recipe.md; consecutive entries with the same sentence share it
    fsdp: bool = False  # its update runs on FSDP2's sharded (DTensor) parameters
    bitsandbytes: bool = False  # the class comes from bitsandbytes (the run imports it)
    fused_kernel: bool = False  # torch's fused kernel on CUDA (one launch per step), its foreach path on the CPU
    eight_bit: str | None = None  # the optimizer with 8-bit state the plan suggests in its place to save memory


ADAM = ("learning_rate", "adam_betas", "adam_eps", "weight_decay")
PAGED = "state in paged memory that spills to the CPU under GPU memory pressure."

OPTIMIZERS = {
    "adamw": Optimizer("torch.optim:AdamW", ADAM, 8, "two fp32 moments",
                       "torch AdamW (fused kernel on CUDA, foreach on CPU).", fsdp=True, fused_kernel=True,
                       eight_bit="adamw_8bit"),
    "adamw_8bit": Optimizer("bitsandbytes.optim:AdamW8bit", ADAM, 2, "two 8-bit moments",
                            "bitsandbytes 8-bit state (about 4x less optimizer memory).", bitsandbytes=True),
    "paged_adamw_8bit": Optimizer("bitsandbytes.optim:PagedAdamW8bit", ADAM, 2, "two 8-bit moments (paged)", PAGED,
                                  bitsandbytes=True),
    "paged_adamw_32bit": Optimizer("bitsandbytes.optim:PagedAdamW32bit", ADAM, 8, "two fp32 moments (paged)", PAGED,
                                   bitsandbytes=True, eight_bit="adamw_8bit"),
    "adafactor": Optimizer("torch.optim:Adafactor", ("learning_rate", "weight_decay"), 0.1,
                           "factored second moments (rows + columns)", "factored second moments (torch)."),
    # its momentum buffer exists only with training.momentum > 0 (see state_per_parameter)
    "sgd": Optimizer("torch.optim:SGD", ("learning_rate", "momentum", "weight_decay"), 4, "fp32 momentum",
                     "with `momentum`.", fsdp=True),
    # Lion: its own default betas (adam_betas are Adam's), no eps
    "lion_8bit": Optimizer("bitsandbytes.optim:Lion8bit", ("learning_rate", "weight_decay"), 1, "one 8-bit moment",
                           "bitsandbytes Lion (use a 3-10x lower learning rate than AdamW).", bitsandbytes=True),
}
OPTIMIZER_NAMES = tuple(OPTIMIZERS)
FSDP_OPTIMIZERS = tuple(name for name, optimizer in OPTIMIZERS.items() if optimizer.fsdp)


def state_per_parameter(name: str, momentum: float) -> tuple[float, str]:
    """(bytes of optimizer state per trained parameter, what they are) for optimizer `name`. An optimizer built
    with `momentum` keeps no buffer when it is 0."""
    optimizer = OPTIMIZERS[name]
    if "momentum" in optimizer.settings and not momentum:
        return 0, "no state"
    return optimizer.state_bytes, optimizer.state


def optimizers_doc() -> str:
    """The schema's description of training.optimizer: each name with its sentence, names that share one
    joined (`a` / `b`: ...)."""
    groups: list[tuple[list[str], str]] = []
    for name, optimizer in OPTIMIZERS.items():
        if groups and groups[-1][1] == optimizer.doc:
            groups[-1][0].append(name)
        else:
            groups.append(([name], optimizer.doc))
    return " ".join(" / ".join(f"`{name}`" for name in names) + f": {doc}" for names, doc in groups)
