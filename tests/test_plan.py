"""gpupoor plan: the terms against what torch really holds, the verdict, the suggestions, --fit, the preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gpupoor import plan as planning
from gpupoor.cli import app
from gpupoor.recipe import Recipe, load_recipe

from conftest import read_metrics

runner = CliRunner()
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LLAMA = dict(hidden=64, intermediate=176, heads=4, kv_heads=2)


def saved_bytes_of_one_layer(rank=8, dropout=0.0, attention="sdpa", targets="all-linear",
                             batch=2, seq=64, autocast_bf16=False, checkpointing=False) -> float:
    """What autograd keeps for one decoder layer: the saved tensors of a 2-layer model minus a 1-layer one,
    unique storages, parameters excluded."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    totals = []
    for layers in (1, 2):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=300, hidden_size=LLAMA["hidden"], intermediate_size=LLAMA["intermediate"],
                             num_hidden_layers=layers, num_attention_heads=LLAMA["heads"],
                             num_key_value_heads=LLAMA["kv_heads"], use_cache=False)
        dtype = torch.bfloat16 if autocast_bf16 else torch.float32
        model = LlamaForCausalLM._from_config(config, attn_implementation=attention, dtype=dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                                                 target_modules=targets))
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def keep(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, 300, (batch, seq))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            model.base_model.model.model(input_ids=ids)
        totals.append(sum(n for ptr, n in seen.items() if ptr not in params))
    return totals[1] - totals[0]


def planned_layer_bytes(rank=8, dropout=0.0, attention="sdpa", targets=planning.LINEARS, batch=2, seq=64,
                        precision="fp32") -> float:
    shape = planning.Shape("llama", LLAMA["hidden"], LLAMA["intermediate"], 2, LLAMA["heads"], LLAMA["kv_heads"],
                           LLAMA["hidden"] // LLAMA["heads"], 300, False, False)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x", "attention": attention},
                                    "data": {"path": "x.jsonl", "max_length": seq},
                                    "peft": {"rank": rank, "dropout": dropout, "target_modules": list(targets)},
                                    "precision": precision, "training": {"micro_batch_size": batch}})
    settings = planning.resolve_settings(recipe, "cpu", shape)
    return planning.layer_saved_bytes_per_token(shape, settings, seq, masked=False) * batch * seq


@pytest.mark.parametrize("case", [
    {}, {"rank": 32}, {"dropout": 0.1}, {"attention": "eager"}, {"targets": ("q_proj", "v_proj")},
    {"seq": 200, "batch": 1},
])
def test_activation_term_equals_what_autograd_saves(case):
    targets = case.get("targets", "all-linear")
    measured = saved_bytes_of_one_layer(rank=case.get("rank", 8), dropout=case.get("dropout", 0.0),
                                        attention=case.get("attention", "sdpa"),
                                        targets=list(targets) if targets != "all-linear" else targets,
                                        batch=case.get("batch", 2), seq=case.get("seq", 64))
    planned = planned_layer_bytes(rank=case.get("rank", 8), dropout=case.get("dropout", 0.0),
                                  attention=case.get("attention", "sdpa"),
                                  targets=case.get("targets", planning.LINEARS),
                                  batch=case.get("batch", 2), seq=case.get("seq", 64))
    assert planned == pytest.approx(measured, rel=0.02), (planned, measured)


def test_checkpointed_layers_keep_only_their_input():
    measured = saved_bytes_of_one_layer(checkpointing=True)

    def activations(layers):
        shape = planning.Shape("llama", LLAMA["hidden"], LLAMA["intermediate"], layers, LLAMA["heads"],
                               LLAMA["kv_heads"], LLAMA["hidden"] // LLAMA["heads"], 300, False, False)
        recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl", "max_length": 64},
                                        "peft": {"rank": 8}, "training": {"micro_batch_size": 2},
                                        "memory": {"gradient_checkpointing": True}})
        return planning.activation_bytes(shape, planning.resolve_settings(recipe, "cpu", shape))[0]

    assert activations(2) - activations(1) == measured  # hidden x 4 bytes x 128 tokens


def test_half_precision_activation_term_is_close_to_autocast():
    measured = saved_bytes_of_one_layer(autocast_bf16=True)
    planned = planned_layer_bytes(precision="bf16")
    assert planned == pytest.approx(measured, rel=0.10), (planned, measured)


def test_parameter_count_matches_the_model(tiny_model, tiny_tied_model, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    qwen = tmp_path / "qwen"  # biases on q, k, v
    Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(qwen)
    for path in (tiny_model, tiny_tied_model, qwen):
        shape, _ = planning.load_shape(load_recipe_for(path))
        model = AutoModelForCausalLM.from_pretrained(path)
        assert shape.total_params == sum(p.numel() for p in model.parameters()), path


def load_recipe_for(model_dir: Path):
    from gpupoor.recipe import LoadedRecipe

    return LoadedRecipe(Recipe.model_validate({"model": {"name_or_path": str(model_dir)},
                                               "data": {"path": "x.jsonl"}}), None)


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_plan_works_for_every_shipped_recipe_offline(name, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, ["plan", str(RECIPES / name), "--device", "cuda", "--memory", "80GiB", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["fits"] is True
    assert plan["peak_bytes"] == sum(term["bytes"] for term in plan["terms"].values())
    assert set(plan["terms"]) == {"base_weights", "trainable", "gradients", "optimizer", "activations", "loss",
                                  "overhead"}
    assert all(term["bytes"] > 0 for term in plan["terms"].values())


def test_quantization_and_checkpointing_lower_their_terms(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(RECIPES / "qwen2.5-1.5b-lora.yaml")

    def terms(*sets):
        args = ["plan", recipe, "--device", "cuda", "--memory", "80GiB", "--json"]
        out = runner.invoke(app, args + [a for s in sets for a in ("--set", s)])
        return {k: v["bytes"] for k, v in json.loads(out.output)["terms"].items()}

    base = terms()
    assert terms("quantization.bits=4")["base_weights"] < 0.45 * base["base_weights"]
    assert terms("memory.gradient_checkpointing=false")["activations"] > 5 * base["activations"]
    assert terms("memory.fused_cross_entropy=false")["loss"] > 10 * base["loss"]
    assert terms("training.optimizer=adamw_8bit")["optimizer"] == pytest.approx(base["optimizer"] / 4, rel=0.01)


def test_not_fitting_lists_changes_and_fit_writes_a_recipe_that_fits(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "qwen.yaml"
    source.write_text((RECIPES / "qwen2.5-1.5b-lora.yaml").read_text())
    original = source.read_text()
    args = ["plan", str(source), "--device", "cuda", "--memory", "4GiB", "--set", "memory.gradient_checkpointing=false"]
    result = runner.invoke(app, args + ["--json"])
    assert result.exit_code == 3, result.output
    plan = json.loads(result.output)
    assert plan["fits"] is False and plan["suggestions"]
    # Each suggestion against an independent re-plan of the recipe with its change applied (a new `plan`
    # command with --set): the peak it promises, and the saving as the drop from this plan's peak. They
    # are single changes that each fit or, when none does, each save something: either way, all or none fit.
    replans = []
    for suggestion in plan["suggestions"]:
        assert suggestion["cost"]
        sets = [a for k, v in suggestion["changes"].items() for a in ("--set", f"{k}={json.dumps(v)}")]
        changed = json.loads(runner.invoke(app, args + sets + ["--json"]).output)
        assert changed["peak_bytes"] == suggestion["peak_bytes"] < plan["peak_bytes"]
        assert suggestion["saving_bytes"] == plan["peak_bytes"] - changed["peak_bytes"]
        replans.append(changed)
    assert len({r["fits"] for r in replans}) == 1
    assert plan["fit_changes"]["memory.gradient_checkpointing"] is True

    text = runner.invoke(app, args)
    assert "what to change" in text.output and "gradient_checkpointing: true" in text.output

    written = runner.invoke(app, args + ["--fit"])
    assert written.exit_code == 0, written.output
    fitted = tmp_path / "qwen.fit.yaml"
    assert source.read_text() == original  # the user's recipe is never rewritten
    again = runner.invoke(app, ["plan", str(fitted), "--device", "cuda", "--memory", "4GiB", "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["fits"] is True
    loaded = load_recipe(fitted).recipe
    for key, value in plan["fit_changes"].items():
        section, field = key.split(".")
        assert getattr(getattr(loaded, section), field) == value
    assert loaded.data.path == load_recipe(source).recipe.data.path  # relative paths still resolve


@pytest.mark.parametrize("value", ["lots", "0", "0.5"])
def test_memory_option_errors_name_the_option(make_recipe, value):
    result = runner.invoke(app, ["plan", str(make_recipe()), "--memory", value])
    assert result.exit_code == 2 and f"--memory '{value}'" in result.output


def test_max_gpu_memory_caps_the_weights_and_an_adapted_head_uses_the_plain_loss(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(RECIPES / "qwen2.5-1.5b-lora.yaml")

    def terms(*sets):
        out = runner.invoke(app, ["plan", recipe, "--device", "cuda", "--memory", "80GiB", "--json",
                                  *[a for s in sets for a in ("--set", s)]])
        return {k: v["bytes"] for k, v in json.loads(out.output)["terms"].items()}

    assert terms("memory.max_gpu_memory=1GiB")["base_weights"] == 2**30
    assert terms("peft.target_modules=[q_proj,lm_head]")["loss"] > 10 * terms("peft.target_modules=[q_proj]")["loss"]
    trained_head = terms("peft.modules_to_save=[lm_head]")["loss"] - terms()["loss"]
    assert trained_head == 151936 * 1536 * 4  # its fp32 gradient


@pytest.mark.parametrize("config, words", [
    ("{not json", "not readable JSON"),
    ('{"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 8}', "mixture-of-experts"),
    ('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
     '"num_attention_heads": 0, "vocab_size": 100}', "positive integers"),
])
def test_bad_model_configs_are_clear_errors(tmp_path, make_recipe, config, words):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    result = runner.invoke(app, ["plan", str(make_recipe(model={"name_or_path": str(model)}))])
    assert result.exit_code == 2 and words in result.output, result.output


def test_unsupported_architecture_is_a_clear_error(tmp_path, make_recipe):
    model = tmp_path / "gpt2ish"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    result = runner.invoke(app, ["plan", str(make_recipe(model={"name_or_path": str(model)}))])
    assert result.exit_code == 2
    assert "hidden_size" in result.output and "Llama family" in result.output


@pytest.fixture
def small_gpu(monkeypatch):
    """Make the preflight believe it runs on a CUDA GPU with 64 MiB free."""
    monkeypatch.setattr(planning, "default_device", lambda recipe: "cuda")
    monkeypatch.setattr(planning, "device_memory", lambda device: (64 * planning.MiB, "test GPU"))


def test_preflight_stops_train_and_validate_before_loading_on_a_gpu_that_is_too_small(small_gpu, make_recipe, tmp_path):
    recipe = make_recipe()
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(recipe), "--output-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert "does not fit" in result.output and "--force" in result.output and "what to change" in result.output
    assert not run_dir.exists()
    result = runner.invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 2 and "does not fit" in result.output
    assert runner.invoke(app, ["validate", str(recipe), "--force"]).exit_code == 0


def test_force_trains_anyway_and_metrics_keep_predicted_and_measured_peaks(small_gpu, make_recipe, tmp_path):
    # training.device auto still resolves to this machine's CPU: --force lets it start.
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(make_recipe()), "--output-dir", str(run_dir), "--force"])
    assert result.exit_code == 0, result.output
    assert "does not fit" in result.output and "--force" in result.output
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    # the preflight planned for the (pretend) GPU; the run found the CPU and planned again for it
    cpu_plan = planning.make_plan(load_recipe(run_dir / "recipe.yaml"), "cpu")
    assert steps and all(r["predicted_peak_mb"] == round(cpu_plan.comparable_peak / 2**20, 1) for r in steps)
    assert "MiB planned" in result.output and "process RSS" in result.output


def test_cpu_run_reports_planned_vs_measured_peak(make_recipe, tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", str(make_recipe()), "--output-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "memory plan: peak" in result.output and "MiB planned" in result.output
    planned = planning.make_plan(load_recipe(run_dir / "recipe.yaml"), "cpu")
    for record in (r for r in read_metrics(run_dir) if "loss" in r):
        assert record["predicted_peak_mb"] == round(planned.comparable_peak / 2**20, 1)
