"""Which loss a recipe trains with, and how the startup summary names it: cross-entropy (fused through the output
head where it can be), distillation against a teacher, DPO/ORPO on preference pairs, or GRPO on sampled answers;
and the eval sums, which stay the cross-entropy with distillation (comparable across runs) and are the pairs' or
the answers' own otherwise. What the objective is (its data, what it sums over, its sections) is its entry in
gpupoor/objective_table.py; this module builds its loss.

It takes the built models, not the run: `model` is the trained model (unwrapped), `teacher` the frozen
distillation teacher, `reference` DPO's frozen reference copy (each None when the recipe has none)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

from gpupoor.objective_table import objective_of, steps_per_sampling
from gpupoor.recipe.schema import Recipe


@dataclass(frozen=True)
class ChosenLoss:
    """The recipe's objective as the loop runs it (gpupoor.train.loop.LoopSettings' fields of the same names)."""

    loss_fn: Callable  # (model, batch) -> the loss summed over `count_units` (and its metrics' sums)
    eval_fn: Callable  # (model, batch) -> the eval sums
    name: str  # how the start-up summary names it
    count_units: Callable  # what the loss is a sum over, counted in a batch: target tokens, pairs or prompts
    metric_names: tuple[str, ...] = ()
    eval_metric_names: tuple[str, ...] | None = None  # None: metric_names
    window_repeats: int = 1  # optimizer steps on each sampled window (grpo.iterations)

    def with_loss(self, loss_fn: Callable) -> "ChosenLoss":
        return replace(self, loss_fn=loss_fn)


def choose_loss(recipe: Recipe, model, *, device: str, teacher=None, reference=None, tokenizer=None,
                state_of=None, rank: int = 0, processes: int = 1) -> ChosenLoss:
    """The training loss, its eval sums, what it is a sum over and its metrics' names. GRPO samples with
    `tokenizer` and reads the run's step from `state_of()` (the TrainState now); `rank` is this process's, of
    `processes`."""
    from gpupoor.objectives.cross_entropy import (find_fused_head, fused_eval_sums, fused_loss_sum, plain_eval_sums,
                                                  plain_loss_sum)

    objective = objective_of(recipe)
    count_units = unit_counter(objective.unit)
    fused, reason = find_fused_head(model, enabled=recipe.memory.fused_cross_entropy)
    if objective.samples:
        return _grpo_loss(recipe, model, fused, reason, tokenizer, state_of, rank, processes, count_units)
    if objective.pairs:
        return _preference_loss(recipe, model, reference, fused, reason, device=device, count_units=count_units)
    cross_entropy = functools.partial(fused_loss_sum, fused=fused) if fused is not None else plain_loss_sum
    evaluation = functools.partial(fused_eval_sums, fused=fused) if fused is not None else plain_eval_sums
    name = f"{'fused chunked cross-entropy' if fused is not None else 'plain cross-entropy'} ({reason})"
    if teacher is not None:
        cross_entropy, name = _distill_loss(recipe, teacher, fused)
    return ChosenLoss(cross_entropy, evaluation, name, count_units)


def unit_counter(unit: str) -> Callable:
    """What counts an objective's unit (its table entry's `unit`) in a collated batch: the loss is a sum over
    them, divided by their count over the accumulation window and the processes."""
    from gpupoor.data.build import count_pairs, count_targets
    from gpupoor.objectives.grpo.objective import count_prompts

    return {"targets": count_targets, "pairs": count_pairs, "prompts": count_prompts}[unit]


def _preference_loss(recipe: Recipe, model, reference_copy, head, reason: str, *, device: str,
                     count_units: Callable) -> ChosenLoss:
    """DPO or ORPO on pairs (training and eval), with DPO's reference: the model with its adapter switched off, or
    the frozen copy build_session loaded."""
    from gpupoor.decisions import choose_reference, evaluates_in_train_mode
    from gpupoor.objectives.cross_entropy import find_fused_head
    from gpupoor.objectives.preference import METRICS, PreferenceLoss, Reference, frozen_head

    preference, objective = recipe.preference, recipe.training.objective
    choice = choose_reference(objective, preference.reference, recipe.peft.method)
    reference = None
    if choice.value == "adapter_off":
        reference = Reference(model, frozen_head(model, head), adapter_off=True,
                              eval_mode=not evaluates_in_train_mode(recipe.quantization.bits, device))
    elif choice.value == "copy":
        reference_head, _ = find_fused_head(reference_copy, enabled=recipe.memory.fused_cross_entropy)
        # The copy stays in the mode gpupoor.model.frozen.build_reference chose (decisions.evaluates_in_train_mode).
        reference = Reference(reference_copy, reference_head, adapter_off=False, eval_mode=False)
    loss = PreferenceLoss(objective, head, reference, preference.beta, preference.loss_type,
                          preference.label_smoothing, preference.orpo_lambda)
    if objective == "dpo":
        smoothing = f", label smoothing {preference.label_smoothing:g}" if preference.label_smoothing else ""
        what = (f"DPO {preference.loss_type} (beta {preference.beta:g}{smoothing}); reference {choice.value} "
                f"({choice.reason})")
    else:
        what = f"ORPO (lambda {preference.orpo_lambda:g}; no reference model)"
    path = "fused chunked log-probabilities" if head is not None else "log-probabilities from full logits"
    return ChosenLoss(loss, loss.evaluate, f"{what}; {path} ({reason})", count_units, METRICS[objective])


def _grpo_loss(recipe: Recipe, model, head, reason: str, tokenizer, state_of, rank: int, processes: int,
               count_units: Callable) -> ChosenLoss:
    """GRPO's objective (gpupoor.objectives.grpo.objective): samples with the bare model; its reference, for
    beta > 0, is that model with its adapter switched off. The update reads each prompt once for its group where
    it can (one process, no gradient checkpointing). A sum over prompts, grpo.iterations steps on each sampling."""
    from gpupoor.objectives.grpo.objective import GrpoObjective

    share = processes == 1 and not recipe.memory.gradient_checkpointing
    loss = GrpoObjective(recipe.grpo, tokenizer, generator=model, head=head, seed=recipe.seed, rank=rank,
                         state_of=state_of, reference=recipe.grpo.beta > 0, share_prompts=share)
    path = "log-probabilities chunked through the fused head" if head is not None else \
        "log-probabilities from full logits"
    return ChosenLoss(loss, loss.evaluate, f"{loss.describe()}; {path} ({reason})", count_units,
                      loss.metric_names, loss.eval_metric_names, window_repeats=steps_per_sampling(recipe))


def _distill_loss(recipe: Recipe, teacher, student_head):
    """The distillation loss: fused through both output heads where both can be, else from full logits."""
    from gpupoor.objectives.cross_entropy import find_fused_head
    from gpupoor.objectives.distill import distill_loss_sum, plain_distill_loss_sum

    distill = recipe.distill
    teacher_head, reason = find_fused_head(teacher, enabled=recipe.memory.fused_cross_entropy)
    settings = f"T {distill.temperature}, KL weight {distill.weight}, teacher {distill.teacher}"
    if student_head is not None and teacher_head is not None:
        def loss(model, batch):
            return distill_loss_sum(model, teacher, batch, student_head, teacher_head, distill.temperature,
                                    distill.weight)

        return loss, f"fused distillation KL + cross-entropy ({settings})"

    def plain(model, batch):
        return plain_distill_loss_sum(model, teacher, batch, distill.temperature, distill.weight)

    return plain, f"distillation KL + cross-entropy from full logits ({settings}; {reason})"
