"""What to change when a recipe does not fit: each knob's next step, cheapest first, with the peak it predicts;
the cheapest combination that fits (what `plan --fit` writes); and with several processes, ddp against fsdp."""

from __future__ import annotations

from gpupoor.method_table import METHODS
from gpupoor.optimizers import OPTIMIZERS
from gpupoor.plan.device import GpuFacts
from gpupoor.plan.peak import peak_bytes
from gpupoor.plan.result import StrategyFit, Suggestion
from gpupoor.plan.settings import strategy_of
from gpupoor.model.shape import Shape
from gpupoor.recipe.schema import Recipe

CANDIDATES = (  # cheapest first: what a user gives up for the saving
    ("memory.fused_cross_entropy", "none: the same loss, computed in chunks"),
    ("training.optimizer", "8-bit optimizer moments: negligible effect on fine-tuning quality"),
    ("memory.gradient_checkpointing", "~25% slower steps: each layer's forward runs again in backward "
     "(offload: also copies layer inputs to and from the CPU)"),
    ("training.micro_batch_size", "about the same examples per optimizer step (accumulation raised); smaller "
     "kernels, a little slower"),
    ("distill.bits", "a 4-bit NF4 teacher: slower teacher forward, its distributions shift a little"),
    ("quantization.bits", "QLoRA: 4-bit NF4 base weights, slower matmuls, a small quality loss"),
    ("data.max_length", "examples longer than this are truncated"),
)


def candidate_change(recipe: Recipe, key: str, device: str) -> dict | None:
    """The next step on one knob from the recipe's current value, or None when there is none."""
    if key == "memory.fused_cross_entropy":
        return None if recipe.memory.fused_cross_entropy else {key: True}
    if key == "training.optimizer":  # (fsdp cannot step an 8-bit optimizer: the recipe refuses the pair)
        eight_bit = OPTIMIZERS[recipe.training.optimizer].eight_bit
        return {key: eight_bit} if eight_bit and recipe.distributed.strategy != "fsdp" else None
    if key == "memory.gradient_checkpointing":
        current = recipe.memory.gradient_checkpointing
        if not current:
            return {key: True}
        return {key: "offload"} if current is True and device == "cuda" else None
    if key == "training.micro_batch_size":
        micro, accumulation = recipe.training.micro_batch_size, recipe.training.gradient_accumulation_steps
        if micro == 1:
            return None
        half = micro // 2  # the same examples per optimizer step, in smaller micro-batches
        return {key: half, "training.gradient_accumulation_steps": -(-micro * accumulation // half)}
    if key == "distill.bits":
        return {key: 4} if recipe.distill is not None and recipe.distill.bits != 4 else None
    if key == "quantization.bits":  # full fine-tuning trains the base weights: they cannot be quantized
        return {key: 4} if recipe.quantization.bits is None and METHODS[recipe.peft.method].adapter else None
    if key == "data.max_length":
        return {key: recipe.data.max_length // 2} if recipe.data.max_length >= 512 else None
    raise KeyError(key)


def apply_changes(recipe: Recipe, changes: dict) -> Recipe:
    tree = recipe.model_dump()
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return Recipe.model_validate(tree)


def suggest(shape: Shape, recipe: Recipe, *, device: str, memory: int, gpu: GpuFacts = GpuFacts(),
            teacher: Shape | None = None, processes: int = 1) -> tuple[list[Suggestion], dict | None]:
    """Single changes that each make the recipe fit (cheapest first), or, when none does alone, every
    change that saves something; and the cheapest combination that fits (what --fit writes), if any.
    `teacher`: the distillation teacher's shape, when the recipe has one; `memory`: one process's share."""

    def peak_of(candidate: Recipe) -> int:
        return peak_bytes(shape, candidate, device, gpu, teacher=teacher, processes=processes)

    base = peak_of(recipe)
    singles = []
    for key, cost in CANDIDATES:
        changes = candidate_change(recipe, key, device)
        if changes is None:
            continue
        peak = peak_of(apply_changes(recipe, changes))
        if peak < base:
            singles.append(Suggestion(changes, base - peak, cost, peak))
    fitting = [s for s in singles if s.peak <= memory]
    steps: list[dict] = []
    current, current_peak = recipe, base
    for key, _ in CANDIDATES:  # cheapest first; a knob with several steps (micro-batch halving) may repeat
        while current_peak > memory:
            changes = candidate_change(current, key, device)
            if changes is None:
                break
            trial = apply_changes(current, changes)
            trial_peak = peak_of(trial)
            if trial_peak >= current_peak:
                break
            current, current_peak = trial, trial_peak
            steps.append(changes)
    if current_peak > memory:
        return (fitting or singles), None
    # Drop what the last (most expensive) change made unnecessary: try each earlier step without it.
    for step in reversed(steps[:-1]):
        rest = [s for s in steps if s is not step]
        trial = recipe
        for changes in rest:
            trial = apply_changes(trial, changes)
        if peak_of(trial) <= memory:
            steps = rest
    combined = {key: value for changes in steps for key, value in changes.items()}
    return (fitting or singles), combined


def strategy_changes(recipe: Recipe, strategy: str, processes: int) -> dict:
    """The recipe changes that train it with `strategy` ({} when it already does): fsdp also needs an optimizer
    that steps sharded parameters and no memory.max_gpu_memory (the recipe refuses either beside it)."""
    changes = {} if strategy_of(recipe, processes) == strategy else {"distributed.strategy": strategy}
    if strategy == "fsdp" and not OPTIMIZERS[recipe.training.optimizer].fsdp:
        changes["training.optimizer"] = "adamw"  # sharding splits its fp32 moments N ways
    if strategy == "fsdp" and recipe.memory.max_gpu_memory is not None:
        changes["memory.max_gpu_memory"] = None
    return changes


def compare_strategies(shape: Shape, recipe: Recipe, *, device: str, gpu: GpuFacts, teacher: Shape | None,
                       processes: int, budget: int | None) -> dict[str, StrategyFit]:
    """One process's peak under ddp and under fsdp, and whether it fits `budget` (one process's memory)."""
    fits = {}
    for strategy in ("ddp", "fsdp"):
        changes = strategy_changes(recipe, strategy, processes)
        peak = peak_bytes(shape, apply_changes(recipe, changes), device, gpu, teacher=teacher, processes=processes)
        fits[strategy] = StrategyFit(peak, None if budget is None else peak <= budget, changes)
    return fits
