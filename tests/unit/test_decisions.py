"""Each decision of gpupoor.decisions asserted directly, the units parsed and formatted, and the agreement that
the module exists for: `plan` predicts the device, precision, attention, sampler and loss path that training
builds from the same facts."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest

from gpupoor import decisions, hardware
from gpupoor.plan.device import default_device, gpu_facts
from gpupoor.plan.settings import resolve_settings
from gpupoor.model.shape import Shape, shape_from_config
from gpupoor.errors import UserError
from gpupoor.recipe.schema import Recipe
from gpupoor.units import format_bytes, format_duration, parse_duration, parse_size


# ------------------------------------------------------------------------------------------ each decision
def test_precision():
    auto_t4 = decisions.choose_precision("auto", "cuda", 7)
    assert auto_t4.value == "fp16" and "7.x" in auto_t4.reason and "GradScaler" in auto_t4.reason
    assert decisions.choose_precision("auto", "cuda", 8).value == "bf16"
    assert decisions.choose_precision("auto", "cpu", None).value == "fp32"
    assert decisions.choose_precision("bf16", "cpu", None).value == "bf16"
    with pytest.raises(UserError, match="precision") as bf16_on_t4:
        decisions.choose_precision("bf16", "cuda", 7)
    assert "fp16 or auto" in str(bf16_on_t4.value)
    with pytest.raises(UserError, match="precision = 'fp16'"):
        decisions.choose_precision("fp16", "cpu", None)
    # a GPU plan cannot see: bf16 assumed for auto (fp16 takes the same bytes), explicit requests stand
    assert decisions.choose_precision("auto", "cuda", None).value == "bf16"
    assert decisions.choose_precision("bf16", "cuda", None).value == "bf16"


def test_device():
    assert decisions.choose_device("cpu", True).value == "cpu"
    assert decisions.choose_device("auto", True, "RTX 3060") == decisions.Choice("cuda", "RTX 3060 found")
    assert decisions.choose_device("auto", False).value == "cpu"
    assert decisions.choose_device("cuda", None).value == "cuda"  # plan for another machine
    with pytest.raises(UserError, match=r"sees no CUDA GPU \(torch 9, built for CUDA None\)"):
        decisions.choose_device("cuda", False, torch_build="torch 9, built for CUDA None")


def test_attention():
    assert decisions.choose_attention("auto", "cuda", True, 8).value == "flash_attention_2"
    older = decisions.choose_attention("auto", "cuda", True, 7)
    assert older.value == "sdpa" and "older than Ampere" in older.reason
    assert decisions.choose_attention("auto", "cpu", False, None).reason == "flash-attn not installed: torch SDPA"
    assert decisions.choose_attention("auto", "cuda", True, None).value == "sdpa"  # the larger bound
    assert decisions.choose_attention("eager", "cpu", False, None).value == "eager"
    for machine in [("cpu", True, None), ("cuda", False, 9), ("cuda", True, 7)]:
        with pytest.raises(UserError, match="flash_attention_2"):
            decisions.choose_attention("flash_attention_2", *machine)


def test_sampler():
    remote = decisions.choose_sampler("auto", "sdpa", trust_remote_code=True)
    assert remote.value == "length_grouped" and "remote" in remote.reason
    assert decisions.choose_sampler("auto", "flash_attention_2", False).value == "packed"
    assert decisions.choose_sampler("auto", "flex_attention", False).value == "length_grouped"
    assert decisions.choose_sampler("random", "sdpa", False) == decisions.Choice("random", "data.sampler: random")


def test_fused_loss():
    assert decisions.choose_fused_loss(True, None, head_adapted=False) == (True, "output head fused with the loss")
    fused, why = decisions.choose_fused_loss(True, None, head_adapted=True)
    assert not fused and "adapted" in why
    assert decisions.choose_fused_loss(False, None, False) == (False, "memory.fused_cross_entropy: false")
    fused, why = decisions.choose_fused_loss(True, "final_logit_softcapping", False)
    assert not fused and "final_logit_softcapping" in why
    assert not decisions.choose_fused_loss(True, None, False, has_decoder=False)[0]
    config = {"final_logit_softcapping": 30.0, "logit_scale": 1.0}
    assert decisions.logit_postprocessing(config.get) == "final_logit_softcapping"
    assert decisions.logit_postprocessing({"logit_scale": 1}.get) is None


def test_loss_chunks_and_bitsandbytes():
    assert decisions.loss_chunk_tokens(32_000) == 2**22 // 32_000
    assert decisions.loss_chunk_tokens(256_000) == decisions.MIN_CHUNK_TOKENS
    assert decisions.needs_bitsandbytes("lion_8bit", None) and decisions.needs_bitsandbytes("adamw", 4)
    assert not decisions.needs_bitsandbytes("adamw", None) and not decisions.needs_bitsandbytes("adafactor", None)
    assert set(decisions.BITSANDBYTES_OPTIMIZERS) == {"adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
                                                      "lion_8bit"}


# ------------------------------------------------------------------------------------------------- units
def test_sizes():
    assert parse_size("1TB") == 10**12 and parse_size("1TiB") == 2**40
    assert parse_size("10 gib") == 10 * 2**30 and parse_size("1.5GB") == 1_500_000_000 and parse_size("512") == 512
    for bad in ("lots", "5iB", "10 GiBs", ""):
        with pytest.raises(UserError, match="--memory"):
            parse_size(bad, "--memory")
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(5 * 2**20) == "5 MiB"


def test_a_gpu_memory_size_that_validates_is_the_one_the_loader_uses():
    recipe = {"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl"}}
    assert Recipe.model_validate({**recipe, "memory": {"max_gpu_memory": "1TB"}}).memory.max_gpu_memory == "1TB"
    for bad in ("lots", "12"):  # 12 bytes is no GPU budget
        with pytest.raises(ValueError, match="10GiB"):
            Recipe.model_validate({**recipe, "memory": {"max_gpu_memory": bad}})


def test_durations():
    assert parse_duration("11h30m") == 41400 and parse_duration("90") == 90
    assert [format_duration(s) for s in (7, 754, 3723, -5)] == ["0:07", "12:34", "1:02:03", "0:00"]
    assert [format_duration(s, style="age") for s in (45, 1020, 11100)] == ["45s", "17m", "3h05m"]


# ------------------------------------------------------------------------- plan agrees with training
MACHINES = [("cpu", None, False), ("cpu", None, True), ("cuda", 7, False), ("cuda", 7, True), ("cuda", 8, True),
            ("cuda", 9, False)]


@pytest.fixture
def machine(monkeypatch):
    """Make torch (as hardware and plan read it) report a GPU of a chosen capability, flash-attn or not."""

    def set_machine(device: str, major: int | None, flash: bool) -> None:
        cuda = hardware.torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: device == "cuda")
        monkeypatch.setattr(cuda, "get_device_name", lambda index=0: "Test GPU")
        monkeypatch.setattr(cuda, "get_device_capability", lambda index=0: (major, 0))
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if flash else None) if name == "flash_attn" else real(name, *a))

    return set_machine


def _outcome(decide):
    try:
        return decide()
    except UserError as exc:
        return f"UserError: {exc}"


def _recipe(**overrides) -> Recipe:
    return Recipe.model_validate({"model": {"name_or_path": "x", "attention": overrides.get("attention", "auto"),
                                            "trust_remote_code": overrides.get("trust", False)},
                                  "data": {"path": "x.jsonl", "sampler": overrides.get("sampler", "auto")},
                                  "precision": overrides.get("precision", "auto")})


SHAPE = Shape("llama", 64, 128, 2, 4, 2, 16, 300, False, False)


@pytest.mark.parametrize("device,major,flash", MACHINES)
def test_plan_resolves_what_training_resolves(machine, device, major, flash):
    machine(device, major, flash)
    assert default_device(_recipe()) == hardware.resolve_device("auto").value == device
    gpu = gpu_facts(device)
    for precision, attention, sampler, trust in itertools.product(
            ("auto", "fp32", "fp16", "bf16"), ("auto", "sdpa", "eager", "flash_attention_2"), ("auto", "packed"),
            (False, True)):
        recipe = _recipe(precision=precision, attention=attention, sampler=sampler, trust=trust)

        def training():  # in the order gpupoor.run.session decides: a recipe wrong twice fails on its precision
            chosen_precision = hardware.resolve_precision(precision, device)[0].value
            chosen_attention = hardware.resolve_attention(attention, device).value
            return chosen_precision, chosen_attention, hardware.resolve_sampler(sampler, chosen_attention, trust).value

        def predicted():
            settings = resolve_settings(recipe, device, SHAPE, gpu)
            return settings.precision, settings.attention, settings.sampler

        assert _outcome(predicted) == _outcome(training), (precision, attention, sampler, trust)


@pytest.mark.parametrize("case", ["all_linear", "adapted_head", "trained_head", "softcapped", "fused_off"])
def test_plan_takes_the_loss_path_training_takes(case, tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gpupoor.objectives.cross_entropy import find_fused_head

    targets = ["q_proj", "v_proj", "lm_head"] if case == "adapted_head" else "all-linear"
    save = ["lm_head"] if case == "trained_head" else []
    config = json.loads((tiny_model / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    if case == "softcapped":
        config["final_logit_softcapping"] = model.config.final_logit_softcapping = 30.0
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, modules_to_save=save or None))
    enabled = case != "fused_off"
    head, training_reason = find_fused_head(model, enabled=enabled)

    recipe = Recipe.model_validate({"model": {"name_or_path": str(tiny_model)}, "data": {"path": "x.jsonl"},
                                    "peft": {"target_modules": targets, "modules_to_save": save},
                                    "memory": {"fused_cross_entropy": enabled}})
    settings = resolve_settings(recipe, "cpu", shape_from_config(config, "test"))
    assert (settings.fused_loss, settings.loss_reason) == (head is not None, training_reason)
    assert settings.fused_loss == (case in ("all_linear", "trained_head"))


def test_cpu_threads_follow_the_cores_free_at_start_unless_set():
    from gpupoor.decisions import choose_cpu_threads

    assert choose_cpu_threads(3, usable=2, processes=1, busy=1.9).value == "3"  # the user's number wins
    assert choose_cpu_threads(None, usable=2, processes=1, busy=0.1).value == "2"
    assert choose_cpu_threads(None, usable=2, processes=1, busy=None).value == "2"  # unknown: all of ours
    busy = choose_cpu_threads(None, usable=2, processes=1, busy=1.0)
    assert busy.value == "1" and "1.0 of 2 cores busy at start" in busy.reason and "cpu_threads" in busy.reason
    assert choose_cpu_threads(None, usable=2, processes=1, busy=2.0).value == "1"  # never fewer than one
    assert choose_cpu_threads(None, usable=16, processes=2, busy=4.0).value == "6"  # (16 - 4) / 2 processes
    assert choose_cpu_threads(None, usable=16, processes=2, busy=None).value == "8"
