"""Optimizer and learning-rate schedule from the recipe's training section."""

from __future__ import annotations

import importlib
import math

import torch

from gpupoor.errors import UserError
from gpupoor.optimizers import OPTIMIZERS
from gpupoor.recipe.schema import TrainingSection

# The argument each recipe key of an optimizer's `settings` (gpupoor.optimizers) is passed as.
ARGUMENTS = {"learning_rate": "lr", "adam_betas": "betas", "adam_eps": "eps", "weight_decay": "weight_decay",
             "momentum": "momentum"}


def optimizer_class(name: str) -> type:
    """The class of optimizer `name`, imported now (bitsandbytes only for the runs that use it)."""
    module, _, attribute = OPTIMIZERS[name].build.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except Exception as exc:  # ImportError, or a native library that fails to load
        if not OPTIMIZERS[name].bitsandbytes:
            raise
        raise UserError(f"training.optimizer = {name!r} needs bitsandbytes, which does not import: {exc}",
                        hint="pip install bitsandbytes, or use optimizer: adamw") from None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this process holds in optimizer state tensors (after the first step has created them)."""
    from gpupoor.train.distributed import local_values

    # This process's share: under FSDP the state tensors are shards (DTensors) of the whole.
    return sum(local_values(value).numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def build_optimizer(training: TrainingSection, model: torch.nn.Module, device: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    entry = OPTIMIZERS[training.optimizer]
    arguments = {ARGUMENTS[key]: getattr(training, key) for key in entry.settings}
    if "betas" in arguments:
        arguments["betas"] = tuple(arguments["betas"])
    if entry.fused_kernel:  # the fused kernel is one launch per step on CUDA; foreach is the fast path on CPU
        arguments.update({"fused": True} if device == "cuda" else {"foreach": True})
    return optimizer_class(training.optimizer)(params, **arguments)


def warmup_steps(training: TrainingSection, total_steps: int) -> int:
    if training.warmup_steps is not None:
        return training.warmup_steps
    return math.ceil(training.warmup_ratio * total_steps)


def lr_factor(step: int, warmup: int, total: int, kind: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(training: TrainingSection, optimizer: torch.optim.Optimizer, total_steps: int,
                    warmup: int | None = None, start_step: int = 0):
    """Warmup then decay over `total_steps`. On a resume, `start_step` is the optimizer steps already taken and
    `warmup` the run's own warmup (it never restarts); the schedule is this function of the step for the current
    total, so the first resumed step takes the value at that step (an extended run decays over its new length).
    The peak is each parameter group's `initial_lr`, restored with the optimizer state."""
    warmup = warmup_steps(training, total_steps) if warmup is None else warmup
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps, training.lr_scheduler),
        last_epoch=start_step - 1)
