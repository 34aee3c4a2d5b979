"""The training-objective table (gpupoor/objective_table.py) is the one list the parts read: the schema's names
and docs, the rules (what data each objective takes), validate's unused-section check, the plan's sampling, the
sampler and reference decisions, and what the loss chooser sums over."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from gpupoor.decisions import choose_reference, choose_sampler
from gpupoor.objective_table import OBJECTIVE_NAMES, OBJECTIVES, sections_unused, steps_per_sampling
from gpupoor.recipe.schema import Recipe, TrainingSection


def recipe_of(objective: str, **sections) -> dict:
    fmt = "preference" if OBJECTIVES[objective].pairs else "alpaca"
    recipe = {"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl", "format": fmt},
              "training": {"objective": objective}}
    if OBJECTIVES[objective].samples:
        recipe["grpo"] = {"rewards": [{"scorer": "length<=8"}]}
    return recipe | sections


def test_the_schema_offers_the_tables_objectives_with_their_docs():
    field = TrainingSection.model_fields["objective"]
    assert get_args(field.annotation) == OBJECTIVE_NAMES
    for objective in OBJECTIVES.values():
        assert f"`{objective.name}`: {objective.doc}" in field.description


@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_each_objective_takes_the_data_its_entry_names(name):
    """Pairs objectives take format preference and nothing else; the others refuse it."""
    assert Recipe.model_validate(recipe_of(name)).training.objective == name
    other = recipe_of(name)
    other["data"] = {"path": "x.jsonl", "format": "alpaca" if OBJECTIVES[name].pairs else "preference"}
    with pytest.raises(ValidationError, match="preference"):
        Recipe.model_validate(other)


@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_the_sampler_and_the_reference_follow_the_table(name):
    objective = OBJECTIVES[name]
    sampler = choose_sampler("auto", "sdpa", False, name)
    assert (sampler.value == "length_grouped") == objective.samples, sampler.reason
    reference = choose_reference(name, "auto", "lora")
    assert (reference.value != "none") == objective.reference, reference.reason


@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_a_section_set_for_another_objective_is_said_unused(name):
    """Every objective's own section is read by it; set under any other objective it is unused."""
    sections = {o.section for o in OBJECTIVES.values() if o.section}
    values = {"preference": {"beta": 0.2}, "grpo": {"group_size": 4, "rewards": [{"scorer": "length<=8"}]}}
    recipe = Recipe.model_validate(recipe_of(name, **{s: values[s] for s in sections}))
    assert sections_unused(recipe) == sorted(sections - {OBJECTIVES[name].section})


def test_only_a_sampling_objective_repeats_its_steps():
    for name, objective in OBJECTIVES.items():
        recipe = Recipe.model_validate(recipe_of(name, **({"grpo": {"iterations": 3, "rewards": [
            {"scorer": "length<=8"}]}} if objective.samples else {})))
        assert steps_per_sampling(recipe) == (3 if objective.repeats else 1)
        assert objective.samples == (objective.repeats is not None)


@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_the_loss_sums_over_the_unit_the_table_names(name):
    """The loss chooser's counter for an objective's unit counts that unit in a collated batch: two rows of two
    targets each (after the causal shift), two pairs (sequences 0-3), two prompts (rows)."""
    import torch

    from gpupoor.data.assembly import IGNORE_INDEX
    from gpupoor.objectives.choose import unit_counter

    labels = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 7, 8]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "sequence_index": torch.arange(4)}
    counts = {"targets": 4, "pairs": 2, "prompts": 2}
    assert unit_counter(OBJECTIVES[name].unit)(batch) == counts[OBJECTIVES[name].unit]
