"""The training-objective table: one entry per `training.objective`, read by the recipe's schema (the names and
their docs), its rules, validate's unused-section check, the memory and time plans and the loss chooser
(gpupoor/objectives/choose.py). Torch-free, like the method table (gpupoor/method_table.py).

A new objective (KTO, SimPO, RLOO, ...) is one entry here plus its loss module in gpupoor/objectives/ and its
branch in `choose_loss` (docs/architecture.md walks through it). Its fields say what the rest of gpupoor must
know of it without reading its loss: what one example of its data is, what the loss sums over (and is normalized
by), whether it may read a frozen reference model, whether it samples answers, and which recipe section holds
its settings."""

from __future__ import annotations

from dataclasses import dataclass

# What an example of an objective's data is (data.format and micro_batch_size count these)
ROWS, PAIRS, PROMPTS = "rows", "pairs", "prompts"


@dataclass(frozen=True)
class Objective:
    """What a training objective is, as every part that reads a recipe needs it."""

    name: str
    doc: str  # the recipe reference's text (training.objective)
    title: str  # how the summary, the plan and messages name it ("DPO")
    data: str  # ROWS: single answers; PAIRS: data.format preference (prompt, chosen, rejected); PROMPTS: to sample to
    unit: str  # what the loss is a sum over, normalized by over the accumulation window: targets, pairs or prompts
    section: str | None = None  # its recipe section ("preference", "grpo"): unused by every other objective
    reference: bool = False  # may read a frozen reference model's log-probabilities (preference.reference)
    samples: bool = False  # generates its own answers to the prompts during training
    repeats: str | None = None  # the recipe key of the steps one sampled rollout is trained on ("grpo.iterations")

    @property
    def pairs(self) -> bool:
        """An example is a preference pair: two sequences of up to data.max_length each."""
        return self.data == PAIRS


OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (
    Objective("sft", "the cross-entropy of the target tokens (supervised fine-tuning, distillation).", "SFT",
              data=ROWS, unit="targets"),
    Objective("dpo", "Direct Preference Optimization on `data.format: preference` pairs, against a frozen "
              "reference (`preference.reference`).", "DPO", data=PAIRS, unit="pairs", section="preference",
              reference=True),
    Objective("orpo", "ORPO on the same pairs: the chosen answer's cross-entropy plus an odds-ratio term, with no "
              "reference model.", "ORPO", data=PAIRS, unit="pairs", section="preference"),
    Objective("grpo", "reinforcement learning from the `grpo` section's rewards on answers the model samples to the "
              "data's prompts (a row's answer is only what rewards compare with); `micro_batch_size` counts prompts "
              "(docs/grpo.md).", "GRPO", data=PROMPTS, unit="prompts", section="grpo", samples=True,
              repeats="grpo.iterations"),
)}
OBJECTIVE_NAMES = tuple(OBJECTIVES)
PAIRS_NOTE = (f"With {'/'.join(f'`{o.name}`' for o in OBJECTIVES.values() if o.pairs)} an example is a pair: "
              "`micro_batch_size` counts pairs (with the packed sampler, rows of up to 2 x `data.max_length` tokens, "
              "each holding as many whole pairs as fit) and the loss is normalized by pairs (docs/preference.md).")


def objective_of(recipe) -> Objective:
    """The recipe's training.objective, as its table entry."""
    return OBJECTIVES[recipe.training.objective]


def sections_unused(recipe) -> list[str]:
    """The objectives' recipe sections this recipe sets although its objective does not read them."""
    used = objective_of(recipe).section
    sections = {o.section for o in OBJECTIVES.values() if o.section is not None} - {used}
    return sorted(s for s in sections if getattr(recipe, s).model_fields_set)


def steps_per_sampling(recipe) -> int:
    """Steps one sampled rollout is trained on (grpo.iterations for GRPO); 1 for an objective that samples
    nothing."""
    key = objective_of(recipe).repeats
    if key is None:
        return 1
    section, field = key.split(".")
    return getattr(getattr(recipe, section), field)
