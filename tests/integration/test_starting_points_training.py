"""The integration tier of test_starting_points.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file, save_file

from gpupoor.errors import UserError
from gpupoor.recipe.loading import load_recipe

from support.cli import invoke

from support.starting_points import STARTS, STILL, assert_close, final_eval_loss, foreign_adapter, tensors, train


@pytest.mark.parametrize("name", sorted(STARTS))
def test_a_run_starts_from_the_adapter_it_names(name, make_recipe, tmp_path, monkeypatch):
    peft, more = STARTS[name]
    data = {"eval_rows": 8}  # the same held-out rows in every run (same seed): evaluated at the end of each
    first = train(make_recipe("first.yaml", peft={"rank": 4, **peft}, data=data, **more), tmp_path / "first",
                  monkeypatch)
    # A relative path, against the recipe's folder; the stored recipe records where it came from.
    second_recipe = make_recipe("second.yaml", peft={"rank": 4, **peft, "init_adapter": "first/final"},
                                training=STILL, data=data, **more)
    second = train(second_recipe, tmp_path / "second", monkeypatch)
    stored = yaml.safe_load((second / "recipe.yaml").read_text())
    assert stored["peft"]["init_adapter"] == str((tmp_path / "first" / "final").resolve())
    start = tensors(first / "final")
    assert_close(tensors(second / "final"), start, rel=1e-9)
    # What the second run computes with those weights is what the first run ended with.
    assert final_eval_loss(second) == pytest.approx(final_eval_loss(first), rel=1e-6)
    fresh = train(make_recipe("fresh.yaml", peft={"rank": 4, **peft}, training=STILL, **more), tmp_path / "fresh",
                  monkeypatch)
    assert any((tensors(fresh / "final")[k] - start[k]).abs().max() > 1e-3 for k in start)  # the test can fail


def test_a_run_directory_means_its_final_adapter(make_recipe, tmp_path, monkeypatch):
    first = train(make_recipe("first.yaml"), tmp_path / "first", monkeypatch)
    second = train(make_recipe("second.yaml", peft={"rank": 4, "init_adapter": str(first)}, training=STILL),
                   tmp_path / "second", monkeypatch)
    assert_close(tensors(second / "final"), tensors(first / "final"), rel=1e-9)


def test_any_peft_adapter_directory_of_the_same_settings(foreign_adapter, make_recipe, tmp_path, monkeypatch):
    peft = {"rank": 4, "target_modules": ["q_proj", "v_proj"], "init_adapter": str(foreign_adapter)}
    run = train(make_recipe(peft=peft, training=STILL), tmp_path / "run", monkeypatch)
    assert_close(tensors(run / "final"), tensors(foreign_adapter), rel=1e-9)


def test_targets_that_differ_are_an_error_naming_both(foreign_adapter, make_recipe, tmp_path, monkeypatch):
    # all-linear is only known once the model is built: training (not validate) refuses it.
    recipe = make_recipe(peft={"rank": 4, "init_adapter": str(foreign_adapter)}, training=STILL)
    assert invoke("validate", recipe, monkeypatch=monkeypatch).exit_code == 0
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 2, result.output
    assert f"peft.init_adapter: {foreign_adapter}" in result.output
    assert ("peft.target_modules: the recipe builds [down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj], "
            "the adapter has [q_proj, v_proj]") in result.output


def test_an_adapter_that_is_not_intact_or_not_safetensors_is_refused(foreign_adapter, make_recipe, tmp_path,
                                                                     monkeypatch):
    from gpupoor.model.init_adapter import check_init_adapter

    first = train(make_recipe("first.yaml"), tmp_path / "first", monkeypatch)
    weights = first / "final" / "adapter_model.safetensors"
    state = load_file(weights)
    state = {key: value + 1 for key, value in state.items()}
    save_file(state, weights)  # same names and shapes: only the manifest can tell
    with pytest.raises(UserError, match="adapter_model.safetensors (has .* bytes|is corrupt)"):
        check_init_adapter(load_recipe(make_recipe("second.yaml", peft={"rank": 4, "init_adapter": "first"})))
    (foreign_adapter / "adapter_model.safetensors").rename(foreign_adapter / "adapter_model.bin")
    with pytest.raises(UserError, match="gpupoor loads adapter weights only from safetensors"):
        check_init_adapter(load_recipe(make_recipe("third.yaml", peft={"rank": 4, "init_adapter": "foreign"})))


def test_an_adapter_of_another_base_model_is_a_clear_error(tmp_path, tokenizer, make_recipe, monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gpupoor.model.tiny import build_tiny_llama

    wider = build_tiny_llama(tmp_path / "wider", tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, seed=0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(wider),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "wide-adapter")
    recipe = make_recipe(peft={"rank": 4, "init_adapter": "wide-adapter"}, training=STILL)
    result = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 2, result.output
    assert "tensors do not fit this model" in result.output and str(wider) in result.output


def test_resolved_recipe_of_an_extending_recipe_stands_alone(make_recipe, tmp_path, monkeypatch):
    base = make_recipe("base.yaml")
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {base.name}\ntraining:\n  max_steps: 2\n")
    run = train(child, tmp_path / "run", monkeypatch)
    stored = (run / "recipe.yaml").read_text()
    assert "extends" not in stored and yaml.safe_load(stored)["training"]["max_steps"] == 2
    base.unlink()  # the run dir needs no base file
    assert load_recipe(run / "recipe.yaml").recipe.training.max_steps == 2
    assert json.loads((run / "final" / "manifest.json").read_text())["step"] == 2
