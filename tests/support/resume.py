"""Shared by the resume tests (moved from integration/test_resume.py, whose tests still use them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.runs import reference_runs


# 48 rows, micro batch 4, accumulation 2: 12 micro-batches and 6 optimizer steps per epoch, 9 steps in all.
# Dropout is on, so the restored RNG matters too.
EXACT = {"training": {"max_steps": 9, "gradient_accumulation_steps": 2}, "peft": {"rank": 4, "dropout": 0.1}}


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_model):
    return reference_runs(tmp_path_factory, tiny_model)


@pytest.fixture()
def straight(make_recipe, tmp_path, references):
    """A recipe and its uninterrupted run, for comparison: a copy of the run the module trained once for that
    recipe (a test may change its copy)."""

    def run(fault: str | None = None, **sections) -> tuple[Path, Path]:
        recipe = make_recipe("exact.yaml", **{**EXACT, **sections})
        out = tmp_path / f"straight-{fault or 'plain'}".replace("@", "-").replace(",", "_")
        shutil.copytree(references(fault, **{**EXACT, **sections}), out)
        return recipe, out

    return run
