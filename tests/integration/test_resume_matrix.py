"""Stopped after k optimizer steps (SIGTERM) and resumed, a run is the run trained straight, bit for bit: every
logged record but its timings, and every tensor of final/. One proof, over the training method, the optimizer,
the objective, the sampler and a data mixture; each case also checks what its straight run should show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.cli import invoke
from support.runs import read_metrics
from gpupoor.optimizers import OPTIMIZERS as OPTIMIZER_TABLE
from support.methods import METHODS, final_tensors
from support.mixtures import mixture_recipe
from support.preference import close, dpo_recipe
from support.resume import EXACT
# fixtures the cases ask for by name (request.getfixturevalue)
from support.distill import teacher
from support.mixtures import two_sources
from support.preference import _one_thread, pairs_file  # _one_thread: autouse, as for the DPO test

# The methods' recipe. 48 rows, micro batch 4, accumulation 2: 6 optimizer steps per epoch; 8 steps cross an
# epoch boundary.
TRAINING = {"max_steps": 8, "gradient_accumulation_steps": 2, "learning_rate": 5e-3}
OPTIMIZERS = list(OPTIMIZER_TABLE)  # every optimizer of gpupoor's table: a new one is a new case
TIMINGS = ("tokens_per_s", "step_s", "elapsed_s", "peak_mem_mb", "predicted_peak_mb", "optimizer_state_mb")


def records(run: Path) -> list[dict]:
    """What a run logged at each step and eval, without the timings (which differ run to run)."""
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in read_metrics(run)
            if "loss" in r or "eval_loss" in r]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if "loss" in r]


# A case: (its recipe, the step SIGTERM stops at, check(output, run, fixtures): what its straight run shows).
# `fixtures` is request.getfixturevalue.

def method(name: str):
    def recipe(make_recipe, fixtures):
        peft = {"rank": 4, **METHODS[name]}
        if name != "ia3":
            peft["dropout"] = 0.1  # the restored RNG matters too
        return make_recipe(f"{name}.yaml", peft=peft, training=TRAINING)

    def check(output, run, fixtures):
        assert f"method {METHODS[name]['method']} on" in output
        assert losses(run)[-1] < losses(run)[0], losses(run)

    return recipe, 3, check


def optimizer(name: str):
    def recipe(make_recipe, fixtures):
        if OPTIMIZER_TABLE[name].bitsandbytes:
            pytest.importorskip("bitsandbytes")
        lr = {"sgd": 0.5, "lion_8bit": 1e-3, "adafactor": 0.1}.get(name, 1e-2)
        return make_recipe("straight.yaml", training={"max_steps": 6, "optimizer": name, "learning_rate": lr})

    def check(output, run, fixtures):
        assert "optimizer state" in output
        assert losses(run)[-1] < losses(run)[0]

    return recipe, 3, check


def exact(stop: int, needs: str | None = None, **sections):
    """test_resume's recipe: 9 steps, accumulation and dropout, an epoch boundary crossed."""
    def recipe(make_recipe, fixtures):
        if needs:
            pytest.importorskip(needs)
        return make_recipe("exact.yaml", **{**EXACT, **sections})

    return recipe, stop, lambda output, run, fixtures: None


def distillation():
    def recipe(make_recipe, fixtures):
        return make_recipe(distill={"teacher": str(fixtures("teacher")), "weight": 0.5, "temperature": 2.0},
                           training={"max_steps": 6, "gradient_accumulation_steps": 2},
                           peft={"rank": 4, "dropout": 0.1}, data={"eval_rows": 8})

    return recipe, 3, lambda output, run, fixtures: None


def dpo():
    """Packed pairs, accumulation, dropout and evals; the straight run's adapter merges into the base like peft's
    own merge and generates."""
    def recipe(make_recipe, fixtures):
        return dpo_recipe(make_recipe, fixtures("pairs_file"), "exact.yaml",
                          data={"sampler": "packed", "eval_rows": 4}, peft={"rank": 4, "dropout": 0.1},
                          training={"max_steps": 6, "gradient_accumulation_steps": 2, "eval_every_steps": 3})

    def check(output, run, fixtures):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        assert records(run) and all("rewards/margins" in r or "eval_rewards/margins" in r for r in records(run))
        merged_dir = fixtures("tmp_path") / "merged"
        assert invoke("merge-lora", run, "--output", merged_dir).exit_code == 0
        base = AutoModelForCausalLM.from_pretrained(json.loads((run / "final" / "adapter_config.json").read_text())
                                                    ["base_model_name_or_path"])
        probe = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7]])
        with torch.no_grad():
            expected = PeftModel.from_pretrained(base, run / "final").merge_and_unload()(probe).logits
            merged = AutoModelForCausalLM.from_pretrained(merged_dir)(probe).logits
        assert close(merged, expected, 1e-5)
        result = invoke("generate", run, "--prompt", "sort the lists", "--max-new-tokens", "6")
        assert result.exit_code == 0 and result.output.strip(), result.output

    return recipe, 4, check


def mixture():
    """80 examples per epoch (both sources' size), 60 from main and 20 from extra; 4 examples a step."""
    def recipe(make_recipe, fixtures):
        return mixture_recipe(make_recipe, fixtures("two_sources"), training={"max_steps": 25, "micro_batch_size": 4})

    def check(output, run, fixtures):
        assert "source main: 40 rows" in output and "60 examples per epoch" in output
        assert "source extra: 40 rows" in output and "20 examples per epoch" in output
        steps = [r for r in read_metrics(run) if "loss" in r]
        by_epoch_end = steps[19]["examples_by_source"]  # 20 steps x 4 = one epoch of 80
        assert by_epoch_end == {"main": 60, "extra": 20}
        # Within an epoch the share follows 3:1 up to sampling error (a hypergeometric draw: sd ~ 3 at 40 examples).
        halfway = steps[9]["examples_by_source"]
        assert abs(halfway["main"] - 30) <= 10 and sum(halfway.values()) == 40

    return recipe, 7, check  # stopped in the middle of the first epoch


CASES = {
    **{f"method-{name}": method(name) for name in sorted(METHODS)},
    **{f"optimizer-{name}": optimizer(name) for name in OPTIMIZERS},
    "optimizer-paged_adamw_8bit-exact": exact(4, "bitsandbytes", training={**EXACT["training"],
                                                                          "optimizer": "paged_adamw_8bit"}),
    "sampler-packed-exact": exact(3, data={"sampler": "packed"}),
    "objective-distill": distillation(),
    "objective-dpo": dpo(),
    "mixture-three-to-one": mixture(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stopped_and_resumed_equals_straight_bitwise(case, make_recipe, tmp_path, monkeypatch, request):
    build, stop, check = CASES[case]
    recipe = build(make_recipe, request.getfixturevalue)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    result = invoke("train", recipe, "--output-dir", straight, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    check(result.output, straight, request.getfixturevalue)
    cut = invoke("train", recipe, "--output-dir", stopped, fault=f"sigterm@{stop}", monkeypatch=monkeypatch)
    assert cut.exit_code == 75, cut.output
    assert losses(stopped)[-1] == losses(straight)[stop - 1]  # it stopped where it was told, after that step
    resumed = invoke("resume", stopped, monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    assert records(stopped) == records(straight)  # bitwise: floats compared exactly
    a, b = final_tensors(straight), final_tensors(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
