"""gpupoor plan: the terms against what torch really holds, the verdict, the suggestions, --fit, the preflight."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import gpupoor.plan.make as plan_make
from gpupoor.plan.distributed import fsdp_shares, shard_units
from gpupoor.plan.fit import write_fit
from gpupoor.plan.make import make_plan
from gpupoor.plan.peak import CPU_BITSANDBYTES_BASELINE
from gpupoor.plan.render import render
from gpupoor.plan.settings import Distribution, resolve_settings
from gpupoor.model.shape import LINEARS, Shape, load_shape
from gpupoor.plan.terms import (GLIBC_MMAP_THRESHOLD_MAX, activation_bytes, dora_weight_norm_bytes,
                                heap_retention, heap_served_bytes, layer_saved_bytes_per_token,
                                saved_activation_bytes, trainable_params, weight_bytes)
from gpupoor.cli import app
from gpupoor.recipe.loading import LoadedRecipe, load_recipe
from gpupoor.recipe.schema import Recipe
from gpupoor.units import MiB, format_bytes

from support.memory import saved_tensor_bytes
from support.recipes import PEFT_METHODS, shipped_recipes
from support.runs import read_metrics
from support.plan import LLAMA, apply_method_like_peft, runner, tiny_llama_with, tiny_settings

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def saved_bytes_of_forward(model, decoder, batch=2, seq=64, autocast_bf16=False) -> int:
    """Bytes of what autograd keeps for backward at the end of `decoder`'s forward (conftest.saved_tensor_bytes)."""
    ids = torch.randint(0, 300, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        return saved_tensor_bytes(model, lambda: decoder(input_ids=ids))


def saved_bytes_of_one_layer(rank=8, dropout=0.0, attention="sdpa", targets="all-linear",
                             batch=2, seq=64, autocast_bf16=False, checkpointing=False, method="lora",
                             fused=True) -> float:
    """What autograd keeps for one decoder layer: the saved tensors of a 2-layer model minus a 1-layer one."""
    totals = []
    for layers in (1, 2):
        model, decoder = tiny_llama_with(method, layers, rank=rank, dropout=dropout, attention=attention,
                                         targets=targets, autocast_bf16=autocast_bf16, checkpointing=checkpointing,
                                         fused=fused)
        totals.append(saved_bytes_of_forward(model, decoder, batch, seq, autocast_bf16))
    return totals[1] - totals[0]


def planned_layer_bytes(rank=8, dropout=0.0, attention="sdpa", targets=LINEARS, batch=2, seq=64,
                        precision="fp32", fused=True) -> float:
    shape, settings = tiny_settings(seq=seq, batch=batch, precision=precision, attention=attention, rank=rank,
                                    dropout=dropout, target_modules=list(targets), fused=fused)
    return layer_saved_bytes_per_token(shape, settings, seq, masked=False) * batch * seq


@pytest.mark.parametrize("case", [
    {}, {"rank": 32}, {"dropout": 0.1}, {"attention": "eager"}, {"targets": ("q_proj", "v_proj")},
    {"seq": 200, "batch": 1}, {"fused": False}, {"fused": False, "targets": ("q_proj", "v_proj")},
])
def test_activation_term_equals_what_autograd_saves(case):
    """The fused layers (model.fused_layers, on unless `fused` is False) and the plain modules, each planned as
    autograd keeps them."""
    targets = case.get("targets", "all-linear")
    measured = saved_bytes_of_one_layer(rank=case.get("rank", 8), dropout=case.get("dropout", 0.0),
                                        attention=case.get("attention", "sdpa"),
                                        targets=list(targets) if targets != "all-linear" else targets,
                                        batch=case.get("batch", 2), seq=case.get("seq", 64),
                                        fused=case.get("fused", True))
    planned = planned_layer_bytes(rank=case.get("rank", 8), dropout=case.get("dropout", 0.0),
                                  attention=case.get("attention", "sdpa"),
                                  targets=case.get("targets", LINEARS),
                                  batch=case.get("batch", 2), seq=case.get("seq", 64), fused=case.get("fused", True))
    assert planned == pytest.approx(measured, rel=0.02), (planned, measured)


def test_checkpointed_layers_keep_only_their_input():
    measured = saved_bytes_of_one_layer(checkpointing=True)

    def activations(layers):
        shape = Shape("llama", LLAMA["hidden"], LLAMA["intermediate"], layers, LLAMA["heads"],
                               LLAMA["kv_heads"], LLAMA["hidden"] // LLAMA["heads"], 300, False, False)
        recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl", "max_length": 64},
                                        "peft": {"rank": 8}, "training": {"micro_batch_size": 2},
                                        "memory": {"gradient_checkpointing": True}})
        return activation_bytes(shape, resolve_settings(recipe, "cpu", shape))[0]

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
        shape, _ = load_shape(load_recipe_for(path))
        model = AutoModelForCausalLM.from_pretrained(path)
        assert shape.total_params == sum(p.numel() for p in model.parameters()), path


def load_recipe_for(model_dir: Path):
    return LoadedRecipe(Recipe.model_validate({"model": {"name_or_path": str(model_dir)},
                                               "data": {"path": "x.jsonl"}}), None)


@pytest.mark.parametrize("name", [path.name for path in shipped_recipes()])  # the real model's: tests/real
def test_plan_works_for_every_shipped_recipe_offline(name, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, ["plan", str(RECIPES / name), "--device", "cuda", "--memory", "80GiB", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["fits"] is True
    assert plan["peak_bytes"] == sum(term["bytes"] for term in plan["terms"].values())
    assert set(plan["terms"]) == {"base_weights", "trainable", "gradients", "optimizer", "activations", "loss",
                                  "cuda_workspace", "overhead"}
    assert all(term["bytes"] > 0 for term in plan["terms"].values())


def test_quantization_and_checkpointing_lower_their_terms(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(RECIPES / "qwen2.5-1.5b-lora.yaml")

    def terms(*sets):
        args = ["plan", recipe, "--device", "cuda", "--memory", "80GiB", "--json"]
        out = runner.invoke(app, args + [a for s in sets for a in ("--set", s)])
        assert out.exit_code == 0, out.output
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
    args = ["plan", str(source), "--device", "cuda", "--memory", "4.1GiB", "--set", "memory.gradient_checkpointing=false"]
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
    assert text.exit_code == 3, text.output
    assert "what to change" in text.output and "gradient_checkpointing: true" in text.output

    written = runner.invoke(app, args + ["--fit"])
    assert written.exit_code == 0, written.output
    fitted = tmp_path / "qwen.fit.yaml"
    assert source.read_text() == original  # the user's recipe is never rewritten
    # Only what changed, over the user's recipe (the --set key is one of the changes here).
    tree = yaml.safe_load(fitted.read_text())
    assert tree.pop("extends") == "qwen.yaml"
    assert {f"{section}.{key}": value for section, keys in tree.items() for key, value in keys.items()} \
        == plan["fit_changes"]
    again = runner.invoke(app, ["plan", str(fitted), "--device", "cuda", "--memory", "4.1GiB", "--json"])
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
        assert out.exit_code == 0, out.output
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


@pytest.mark.parametrize("key", ["model", "distill"])
def test_a_model_path_that_is_a_file_is_said_to_be_one(tmp_path, make_recipe, key):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    sections = {"model": {"name_or_path": str(weights)}} if key == "model" else {"distill": {"teacher": str(weights)}}
    result = runner.invoke(app, ["plan", str(make_recipe(**sections))])
    name = "model.name_or_path" if key == "model" else "distill.teacher"
    assert result.exit_code == 2, result.output
    assert f"{name}: {weights} is a file; expected a model directory (config.json and weights" in result.output


def test_unsupported_architecture_is_a_clear_error(tmp_path, make_recipe):
    model = tmp_path / "gpt2ish"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    result = runner.invoke(app, ["plan", str(make_recipe(model={"name_or_path": str(model)}))])
    assert result.exit_code == 2
    assert "hidden_size" in result.output and "Llama family" in result.output


# ------------------------------------------------------------------------------------------------ methods
METHODS = PEFT_METHODS


@pytest.mark.parametrize("case", sorted(METHODS))
def test_trainable_parameter_count_is_what_peft_and_transformers_train(case, tiny_model):
    from transformers import AutoModelForCausalLM

    peft = {"rank": 4, **METHODS[case]}
    model = apply_method_like_peft(AutoModelForCausalLM.from_pretrained(tiny_model), peft["method"], rank=4,
                                   last_layers=peft.get("last_layers"), modules_to_save=peft.get("modules_to_save", ()))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    recipe = Recipe.model_validate({"model": {"name_or_path": str(tiny_model)}, "data": {"path": "x.jsonl"},
                                    "peft": peft})
    plan = make_plan(LoadedRecipe(recipe, None), "cpu", memory=2**40)
    assert plan.trainable_params == trained
    assert next(t.bytes for t in plan.terms if t.key == "trainable") == 4 * trained
    assert plan.method == peft["method"] and f"{trained:,} trainable parameters" in plan.method_detail
    assert json.loads(json.dumps(plan.to_json()))["trainable_params"] == trained
    assert plan.method_detail in render(plan, "recipe.yaml")
    if "last_layers" in peft:
        assert "on the last 1 of 2 layers" in plan.method_detail
    if case == "full":
        assert plan.method_detail == f"method full: {trained:,} trainable parameters (all)"


@pytest.mark.parametrize("method, precision", [("dora", "fp32"), ("ia3", "fp32"), ("full", "fp32"),
                                               ("dora", "bf16"), ("ia3", "bf16"), ("full", "bf16")])
def test_activation_term_of_each_method_equals_what_autograd_saves(method, precision):
    """One decoder layer's share of the activation term (a 2-layer plan minus a 1-layer one) against what
    autograd keeps for it. For full training under bf16 autocast that includes the half copies of the
    layer's fp32 weights (kept for the input gradients)."""
    half = precision == "bf16"
    measured = saved_bytes_of_one_layer(method=method, autocast_bf16=half)

    def activations(layers):
        shape, settings = tiny_settings(layers, precision=precision, method=method, rank=8)
        return activation_bytes(shape, settings)[0]

    planned = activations(2) - activations(1)
    assert planned == pytest.approx(measured, rel=0.10 if half else 0.02), (planned, measured)


def test_dropout_with_dora_keeps_what_autograd_saves():
    measured = saved_bytes_of_one_layer(method="dora", dropout=0.1)
    shape, settings = tiny_settings(method="dora", rank=8, dropout=0.1)
    planned = layer_saved_bytes_per_token(shape, settings, 64, masked=False) * 128
    assert planned == pytest.approx(measured, rel=0.02), (planned, measured)


@pytest.mark.parametrize("method, precision", [("lora", "fp32"), ("dora", "fp32"), ("ia3", "fp32"),
                                               ("full", "fp32"), ("full", "bf16")])
def test_layers_below_last_layers_keep_no_activations(method, precision):
    """last_layers 1 of a 2-layer model: the plan keeps about half of what all layers keep, and a real
    forward with the lower layer frozen keeps what the plan says (the whole decoder's saved tensors)."""
    half = precision == "bf16"

    def planned(last_layers):
        shape, settings = tiny_settings(method=method, rank=8, last_layers=last_layers, precision=precision)
        saved = saved_activation_bytes(shape, settings, masked=False)[0]
        if half:  # the autocast copies of trained fp32 weights are saved tensors too
            saved += 2 * sum(shape.linear_params(n) for layer in settings.training.layers for n in layer.weights)
        return saved, activation_bytes(shape, settings)[0]

    (all_saved, all_term), (last_saved, last_term) = planned(None), planned(1)
    measured = {}
    for last_layers in (None, 1):
        model, decoder = tiny_llama_with(method, 2, rank=8, last_layers=last_layers, autocast_bf16=half)
        measured[last_layers] = saved_bytes_of_forward(model, decoder, autocast_bf16=half)
    tolerance = 0.10 if half else 0.02
    assert last_saved == pytest.approx(measured[1], rel=tolerance), (last_saved, measured[1])
    assert all_saved == pytest.approx(measured[None], rel=tolerance), (all_saved, measured[None])
    assert last_term < all_term
    if half and method == "full":  # all layers: the trained embedding makes the residual stream fp32
        assert last_saved < all_saved / 2 and measured[1] < measured[None] / 2
    else:
        assert last_saved == pytest.approx(all_saved / 2, rel=0.06)
        assert measured[1] == pytest.approx(measured[None] / 2, rel=0.06)


def test_cpu_heap_retention_grows_with_the_layers_that_keep_activations_and_not_with_mmapped_blocks():
    """The heap keeps a share of each layer's allocations for every layer a step runs through (30 layers of the
    real model kept several times what 12 did), and nothing of blocks over glibc's mmap ceiling."""
    def retention(layers, seq=128, batch=8, **peft):
        shape, settings = tiny_settings(layers=layers, seq=seq, batch=batch, **peft)
        churn = activation_bytes(shape, settings)[1]
        return heap_retention(shape, settings, churn), heap_served_bytes(shape, settings, churn), churn

    shallow, _, churn = retention(12, seq=2048)
    deep, served, _ = retention(30, seq=2048)
    assert served == churn  # LLAMA's widths at 8 x 2048 tokens: every tensor is far under 32 MiB
    assert deep > shallow > 0
    assert deep - shallow == pytest.approx(retention(24, seq=2048)[0] - retention(6, seq=2048)[0], rel=1e-3)
    assert retention(30, seq=2048, last_layers=6)[0] == pytest.approx(retention(6, seq=2048)[0], rel=1e-6)
    # at 8 x 8192 tokens the intermediate-width tensors (8192 x 8 x 176 x 4 bytes) pass 32 MiB: not served
    tokens = 8 * 8192
    assert tokens * LLAMA["intermediate"] * 4 > GLIBC_MMAP_THRESHOLD_MAX >= tokens * LLAMA["hidden"] * 4
    _, served_long, churn_long = retention(30, seq=8192)
    assert served_long == pytest.approx(churn_long - 9 * LLAMA["intermediate"] * 4 * tokens, rel=1e-9)


def test_checkpointed_frozen_layers_keep_not_even_their_input():
    def activations(last_layers):
        shape, settings = tiny_settings(method="lora", rank=8, last_layers=last_layers, checkpointing=True)
        return activation_bytes(shape, settings)[0]

    kept_input = LLAMA["hidden"] * 4 * 128
    assert activations(None) - activations(1) == kept_input
    measured = {}
    for last_layers in (None, 1):
        model, decoder = tiny_llama_with("lora", 2, last_layers=last_layers, checkpointing=True)
        measured[last_layers] = saved_bytes_of_forward(model, decoder)
    assert measured[None] - measured[1] == kept_input


def test_dora_weight_norm_working_set_is_measured():
    """DoRA's forward builds W + s*B@A for one module at a time: the plan's figure against glibc's in-use
    bytes after every op of one DoRA linear's forward (what it allocates beyond what it keeps)."""
    import ctypes

    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2")

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = Info

    def in_use():
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    class Peak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.start, self.peak = in_use(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use() - self.start)
            return out

    for half in (False, True):
        for features in ((512, 128), (128, 512), (1024, 1024)):
            torch.manual_seed(0)
            dtype = torch.bfloat16 if half else torch.float32
            layer = get_peft_model(torch.nn.Sequential(torch.nn.Linear(*features, bias=False)).to(dtype),
                                   LoraConfig(r=8, target_modules=["0"], use_dora=True))
            for param in layer.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
            x = torch.randn(4, features[0], dtype=dtype, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
                layer(x)  # warm up
                with Peak() as peak:
                    out = layer(x)
                    kept = in_use() - peak.start
            measured = peak.peak - kept
            del out
            shape = Shape("llama", features[0], features[1], 1, 1, 1, features[0], 8, False, False)
            settings = tiny_settings(precision="bf16" if half else "fp32", method="dora")[1]
            planned = dora_weight_norm_bytes(shape, settings, ("gate_proj",))  # gate: hidden -> intermediate
            assert planned == pytest.approx(measured, rel=0.10), (half, features, planned, measured)


@pytest.fixture
def teacher_model(tmp_path_factory, tokenizer) -> Path:
    from gpupoor.model.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "teacher", tokenizer, hidden=64, layers=3,
                            heads=4, kv_heads=2, seed=3)


def test_distillation_adds_the_teacher_weights_and_the_kl_working_set(make_recipe, teacher_model, monkeypatch,
                                                                     tmp_path_factory):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # the teacher is relative to the recipe, not to here

    def plan(*sets):
        recipe = make_recipe()
        (recipe.parent / "teacher").symlink_to(teacher_model, target_is_directory=True) \
            if not (recipe.parent / "teacher").exists() else None
        result = runner.invoke(app, ["plan", str(recipe), "--device", "cpu", "--memory", "64GiB", "--json",
                                     *[a for s in sets for a in ("--set", s)]])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    alone = plan()
    taught = plan("distill.teacher=teacher")
    taught_4bit = plan("distill.teacher=teacher", "distill.bits=4")
    terms = {name: {k: v["bytes"] for k, v in p["terms"].items()}
             for name, p in (("alone", alone), ("taught", taught), ("4bit", taught_4bit))}
    teacher = AutoModelForCausalLM.from_pretrained(teacher_model)  # fp32: the run's precision on the CPU
    teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters())
    assert "teacher_weights" not in terms["alone"]
    assert terms["taught"]["teacher_weights"] == teacher_bytes
    linear = sum(p.numel() for name, p in teacher.named_parameters() if "proj" in name)
    assert terms["4bit"]["teacher_weights"] == pytest.approx(teacher_bytes - linear * 4 + linear / 2, rel=0.05)
    assert terms["taught"]["loss"] > terms["alone"]["loss"]  # the KL's chunk buffers, the teacher's hidden states
    assert "distillation" in taught["terms"]["loss"]["detail"]
    assert taught["peak_bytes"] > alone["peak_bytes"] + teacher_bytes
    assert taught_4bit["peak_bytes"] < taught["peak_bytes"] + CPU_BITSANDBYTES_BASELINE
    assert "teacher config" in " ".join(taught["assumptions"]) and "distilled from teacher" in taught["method_detail"]


def test_a_teacher_that_does_not_fit_is_suggested_in_4_bit(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(RECIPES / "chat-sft.yaml")  # Qwen2.5-0.5B-Instruct learns from Qwen2.5-1.5B
    args = ["plan", recipe, "--device", "cuda", "--json", "--set", "distill.teacher=Qwen/Qwen2.5-1.5B"]
    fits = json.loads(runner.invoke(app, args + ["--memory", "80GiB"]).output)
    teacher = fits["terms"]["teacher_weights"]["bytes"]
    assert teacher == 1_543_714_304 * 2  # bf16
    tight = runner.invoke(app, args + ["--memory", format(fits["peak_bytes"] - teacher // 2)])
    assert tight.exit_code == 3, tight.output
    plan = json.loads(tight.output)
    assert {"distill.bits": 4} in [s["changes"] for s in plan["suggestions"]]
    assert plan["fit_changes"] is not None


def test_full_fine_tuning_plan_and_fit_never_suggest_a_quantized_base(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "qwen.yaml"
    source.write_text((RECIPES / "qwen2.5-1.5b-lora.yaml").read_text())
    args = ["plan", str(source), "--device", "cuda", "--set", "peft.method=full", "--set",
            "memory.gradient_checkpointing=false"]
    roomy = json.loads(runner.invoke(app, args + ["--memory", "80GiB", "--json"]).output)
    params = 1_543_714_304
    assert roomy["trainable_params"] == params and roomy["method"] == "full"
    assert roomy["method_detail"] == f"method full: {params:,} trainable parameters (all)"
    terms = {k: v["bytes"] for k, v in roomy["terms"].items()}
    assert terms["base_weights"] == 0  # every weight trains: the fp32 master copies are the trainable term
    assert terms["trainable"] == terms["gradients"] == 4 * params and terms["optimizer"] == 8 * params
    result = runner.invoke(app, args + ["--memory", "24GiB", "--json"])
    assert result.exit_code == 3, result.output
    plan = json.loads(result.output)
    assert plan["suggestions"]
    assert all("quantization.bits" not in s["changes"] for s in plan["suggestions"])
    assert plan["fit_changes"] and "quantization.bits" not in plan["fit_changes"]
    assert plan["fit_changes"]["training.optimizer"] == "adamw_8bit"
    written = runner.invoke(app, args + ["--memory", "24GiB", "--fit"])
    assert written.exit_code == 0, written.output
    fitted = yaml.safe_load((tmp_path / "qwen.fit.yaml").read_text())
    assert fitted["peft"] == {"method": "full"}  # the plan was made with this --set: the fitted file keeps it
    again = runner.invoke(app, ["plan", str(tmp_path / "qwen.fit.yaml"), "--device", "cuda", "--memory", "24GiB"])
    assert again.exit_code == 0 and "method full: 1,543,714,304 trainable parameters (all)" in again.output


def test_fit_file_says_what_was_predicted_and_follows_the_users_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "qwen.yaml"
    source.write_text((RECIPES / "qwen2.5-1.5b-lora.yaml").read_text())
    loaded = load_recipe(source, ["memory.gradient_checkpointing=false", "training.learning_rate=3e-4"])
    plan = make_plan(loaded, "cuda", memory=4 * 2**30)
    assert plan.fits is False and plan.fit_changes and plan.fit_peak <= 4 * 2**30
    assert write_fit(loaded, plan.fit_changes, plan) == f"wrote {tmp_path / 'qwen.fit.yaml'}"
    text = (tmp_path / "qwen.fit.yaml").read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert f"peaks at {format_bytes(plan.peak)}" in header and "4.00 GiB" in header
    assert f"with the changes below, {format_bytes(plan.fit_peak)}" in header
    assert "From --set (the plan was made with them): training.learning_rate" in header
    assert yaml.safe_load(text)["training"]["learning_rate"] == 3e-4
    # The user's file stays the source of truth: a later edit there reaches the fitted recipe.
    assert "seed:" not in source.read_text()
    source.write_text(source.read_text() + "seed: 7\n")
    assert load_recipe(tmp_path / "qwen.fit.yaml").recipe.seed == 7


def test_fit_that_cannot_be_written_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "qwen.yaml"
    source.write_text((RECIPES / "qwen2.5-1.5b-lora.yaml").read_text())
    (tmp_path / "qwen.fit.yaml").mkdir()  # where the fitted recipe would go: a directory
    result = runner.invoke(app, ["plan", str(source), "--device", "cuda", "--memory", "4GiB", "--fit"])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'qwen.fit.yaml'} exists and plan --fit did not write it" in result.output


# ---------------------------------------------------------------------------------------- several processes
def distributed_terms(recipe: str, *args: str) -> dict:
    result = runner.invoke(app, ["plan", recipe, "--device", "cuda", "--memory", "80GiB", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("name, bits", [(name, bits) for name in sorted(PEFT_METHODS) for bits in (None, 4)
                                        if not (bits and PEFT_METHODS[name]["method"] == "full")])  # never quantized
def test_fsdp_units_hold_every_trainable_parameter_and_the_frozen_weights_once(name, bits):
    shape, s = tiny_settings(precision="bf16", **PEFT_METHODS[name])
    s = replace(s, bits=bits, distribution=Distribution(2, "fsdp"))
    units, root = shard_units(shape, s)
    assert sum(u.trainable for u in units) + root.trainable == 4 * trainable_params(shape, s)
    assert root.trainable >= 0
    assert all(u.gathered == u.frozen + u.trainable // 2 for u in [*units, root])  # all in bf16 once gathered
    frozen = sum(u.frozen for u in units) + root.frozen
    whole = fsdp_shares(shape, s)["base_weights"][0]
    assert frozen + whole == weight_bytes(shape, s)[0]  # sharded + kept whole = every frozen byte
    assert (whole > 0) == (bits is not None)  # only bitsandbytes' packed linears stay whole


def test_fsdp_on_two_processes_holds_half_the_weights_of_a_full_fine_tune(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(RECIPES / "qwen2.5-1.5b-lora.yaml")
    sets = ["--set", "peft.method=full", "--set", "training.optimizer=adamw", "--set", "distributed.strategy=fsdp"]
    one = {k: v["bytes"] for k, v in distributed_terms(recipe, *sets)["terms"].items()}
    two = {k: v["bytes"] for k, v in distributed_terms(recipe, *sets, "--processes", "2")["terms"].items()}
    # `full`: every weight trains, so the fp32 master weights (the trainable term) are the model's weights
    for key in ("trainable", "gradients", "optimizer"):
        assert two[key] == pytest.approx(one[key] / 2, rel=1e-6), key
    assert "all_gather" in two and "all_gather" not in one
    assert two["loss"] == one["loss"]  # each process its own micro-batch
    # FSDP gathers the trained weights already in bf16: autocast has no fp32 weight to keep a half copy of
    assert one["activations"] - two["activations"] == 2 * (1_543_714_304 - 57 * 1536)  # all but the 57 norms
    lora = {k: v["bytes"] for k, v in distributed_terms(recipe, "--processes", "2", "--set",
                                                         "distributed.strategy=fsdp")["terms"].items()}
    single = {k: v["bytes"] for k, v in distributed_terms(recipe)["terms"].items()}
    assert lora["base_weights"] == pytest.approx(single["base_weights"] / 2, rel=1e-6)  # bf16, halved
    assert lora["activations"] == single["activations"]


@pytest.fixture
def llama_8b(tmp_path, make_recipe) -> Path:
    """A LoRA recipe for Llama-3.1-8B on paper: its config.json alone, no weights. bf16, rank 16 on every
    linear, adamw, 1 x 1024 tokens with gradient checkpointing."""
    model = tmp_path / "llama-3.1-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return make_recipe(model={"name_or_path": str(model)}, data={"max_length": 1024, "sampler": "packed"},
                       peft={"rank": 16}, precision="bf16", training={"micro_batch_size": 1},
                       memory={"gradient_checkpointing": True})


def test_llama_8b_lora_fits_two_16gb_gpus_with_fsdp_and_not_with_ddp(llama_8b):
    args = ["plan", str(llama_8b), "--processes", "2", "--memory", "16GB", "--device", "cuda"]
    fsdp = runner.invoke(app, args + ["--set", "distributed.strategy=fsdp", "--json"])
    assert fsdp.exit_code == 0, fsdp.output
    plan = json.loads(fsdp.output)
    assert plan["fits"] is True and plan["strategy"] == "fsdp"
    terms = {k: v["bytes"] for k, v in plan["terms"].items()}
    assert terms["base_weights"] == 8_030_261_248 * 2 // 2  # bf16, half on each process
    # The all-gather working set, by hand: the root (embeddings + head + final norm) stays gathered through the
    # step, two layers at a time, all in bf16 (LoRA included); one layer's LoRA gradients in bf16 and fp32.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    lora = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336) + (14336 + 4096))
    root = 2 * 128256 * 4096 + 4096
    assert terms["all_gather"] == 2 * root + 2 * 2 * (layer + lora) + (2 + 4) * lora
    ddp = runner.invoke(app, args + ["--json"])
    assert ddp.exit_code == 3, ddp.output
    assert json.loads(ddp.output)["fits"] is False
    assert plan["strategies"]["ddp"]["fits"] is False and plan["strategies"]["fsdp"]["fits"] is True
    text = runner.invoke(app, args).output
    assert "fits with distributed.strategy: fsdp (" in text and "per process), not with ddp (" in text


def test_json_of_several_processes_compares_the_strategies(llama_8b):
    args = ["plan", str(llama_8b), "--memory", "16GB", "--device", "cuda", "--json"]
    single = json.loads(runner.invoke(app, args).output)
    assert "processes" not in single and "strategies" not in single  # one process: the plan as it was
    plan = json.loads(runner.invoke(app, args + ["--processes", "2", "--nodes", "1"]).output)
    assert plan["processes"] == 2 and plan["nodes"] == 1 and plan["strategy"] == "ddp"  # auto: ddp
    assert set(plan["strategies"]) == {"ddp", "fsdp"}
    assert plan["strategies"]["ddp"] == {"peak_bytes": plan["peak_bytes"], "fits": plan["fits"], "changes": {}}
    fsdp = json.loads(runner.invoke(app, args + ["--processes", "2", "--set", "distributed.strategy=fsdp"]).output)
    assert plan["strategies"]["fsdp"]["peak_bytes"] == fsdp["peak_bytes"]  # the comparison is the real plan
    assert plan["strategies"]["fsdp"]["changes"] == {"distributed.strategy": "fsdp"}
    eight_bit = json.loads(runner.invoke(app, args + ["--processes", "2", "--set",
                                                      "training.optimizer=adamw_8bit"]).output)
    assert eight_bit["strategies"]["fsdp"]["changes"] == {"distributed.strategy": "fsdp",
                                                          "training.optimizer": "adamw"}  # fsdp steps no 8-bit
    unknown = json.loads(runner.invoke(app, ["plan", str(llama_8b), "--device", "cpu", "--json", "--processes",
                                             "2", "--memory", "1TiB"]).output)
    assert unknown["processes_sharing_memory"] == 2  # a node's processes share its RAM


def test_ddp_bucket_term_only_with_several_processes(llama_8b, monkeypatch):
    args = ["plan", str(llama_8b), "--memory", "80GB", "--device", "cuda", "--json"]
    one = json.loads(runner.invoke(app, args).output)["terms"]
    assert "ddp_buckets" not in one
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: the default of --processes
    two = json.loads(runner.invoke(app, args).output)["terms"]
    assert two["ddp_buckets"]["bytes"] == two["gradients"]["bytes"] == one["gradients"]["bytes"]
    assert {k: v for k, v in two.items() if k != "ddp_buckets"} == one
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert "ddp_buckets" not in json.loads(runner.invoke(app, args).output)["terms"]


def test_fsdp_options_move_the_terms(llama_8b):
    args = ["plan", str(llama_8b), "--memory", "80GB", "--device", "cuda", "--json", "--processes", "4",
            "--set", "distributed.strategy=fsdp"]
    base = json.loads(runner.invoke(app, args).output)
    terms = {k: v["bytes"] for k, v in base["terms"].items()}
    # reshard_after_forward false: every layer stays gathered until its backward, the unsharded size on top
    kept = json.loads(runner.invoke(app, args + ["--set", "distributed.reshard_after_forward=false"]).output)
    assert kept["terms"]["all_gather"]["bytes"] > 8_030_261_248 * 2 > terms["all_gather"]
    whole = json.loads(runner.invoke(app, args + ["--set", "distributed.shard_frozen=false"]).output)
    assert whole["terms"]["base_weights"]["bytes"] == 8_030_261_248 * 2
    offload = json.loads(runner.invoke(app, args + ["--set", "distributed.cpu_offload=true"]).output)
    moved = ("base_weights", "trainable", "gradients", "optimizer")
    assert all(offload["terms"][key]["bytes"] == 0 for key in moved)
    assert {k: v["bytes"] for k, v in offload["offloaded"].items()} == {key: terms[key] for key in moved}
    assert offload["peak_bytes"] == base["peak_bytes"] - offload["offloaded_bytes"]
    text = runner.invoke(app, [a for a in args if a != "--json"] + ["--set", "distributed.cpu_offload=true"]).output
    assert "in CPU memory (distributed.cpu_offload), not in the peak" in text


def test_a_fsdp_recipe_that_does_not_fit_is_never_offered_an_8_bit_optimizer(llama_8b):
    result = runner.invoke(app, ["plan", str(llama_8b), "--memory", "8GB", "--device", "cuda", "--json",
                                 "--processes", "2", "--set", "distributed.strategy=fsdp"])
    assert result.exit_code == 3, result.output
    plan = json.loads(result.output)
    assert plan["suggestions"] and all("training.optimizer" not in s["changes"] for s in plan["suggestions"])


def test_more_nodes_than_processes_is_an_error(llama_8b):
    result = runner.invoke(app, ["plan", str(llama_8b), "--processes", "2", "--nodes", "3"])
    assert result.exit_code == 2 and "--nodes 3 with --processes 2" in result.output


def test_a_4bit_base_on_the_cpu_keeps_its_file_mapped_and_the_plan_counts_the_pages(tiny_model, make_recipe):
    """On the CPU a quantized load leaves the unquantized tensors (embedding, head) views of the safetensors
    file, so the mapping, with the pages the linears were quantized from, stays resident as long as they live.
    The plan's base weights add those pages when the file's dtype is the run's (views, no conversion); not when
    the file is in another dtype (everything is converted: nothing stays mapped), nor on a GPU."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, device_map={"": "cpu"},
                                                 quantization_config=quantization)
    with open("/proc/self/maps") as maps:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps
                 if line.rstrip().endswith(str(tiny_model / "model.safetensors"))]
    mapped = {name for name, p in model.named_parameters() if any(a <= p.data_ptr() < b for a, b in spans)}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= mapped
    assert not any(name.endswith("_proj.weight") for name in mapped)  # the 4-bit linears are new tensors

    loaded = load_recipe(make_recipe(quantization={"bits": 4}))
    shape, _ = load_shape(loaded)
    assert shape.file_dtype == "fp32"
    cpu = resolve_settings(loaded.recipe, "cpu", shape)
    linear_bytes = shape.layers * shape.layer_linear_params * 4
    assert cpu.weights_mapped
    with_pages = weight_bytes(shape, cpu)[0]
    assert with_pages - weight_bytes(shape, replace(cpu, weights_mapped=False))[0] == linear_bytes
    bf16_file = replace(shape, file_dtype="bf16")
    assert not resolve_settings(loaded.recipe, "cpu", bf16_file).weights_mapped
    assert not resolve_settings(loaded.recipe, "cuda", shape).weights_mapped


def test_fit_replaces_its_own_file_saying_so_and_refuses_the_users(tmp_path, monkeypatch):
    """plan --fit replaced an existing RECIPE.fit.yaml without a word: an earlier fit is replaced and the line says
    so; a file there that plan --fit did not write is the user's, refused (exit 2) before the plan is made."""
    from gpupoor.cli import app
    from typer.testing import CliRunner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "qwen.yaml"
    source.write_text((RECIPES / "qwen2.5-1.5b-lora.yaml").read_text())
    args = ["plan", str(source), "--device", "cuda", "--memory", "4GiB", "--fit", "--no-time"]
    first = CliRunner().invoke(app, args)
    target = tmp_path / "qwen.fit.yaml"
    assert first.exit_code == 0 and f"wrote {target}\n" in first.output, first.output
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and f"wrote {target} (replacing the one an earlier plan --fit wrote)" in again.output
    target.write_text("# my own notes\nseed: 3\n")
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and f"{target} exists and plan --fit did not write it" in refused.output
    assert "peak" not in refused.output  # refused before the plan
    assert target.read_text() == "# my own notes\nseed: 3\n"
