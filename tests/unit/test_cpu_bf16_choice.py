"""`precision: auto` on a CPU: bf16 where the CPU's flags name bf16 matrix units and a matmul probe confirms they
multiply faster, fp32 elsewhere; the facts read from /proc/cpuinfo, pinned by GPUPOOR_CPU_BF16 and measured; the
same rule for generate, chat and export's perplexity; and `plan` deciding what training decides."""

from __future__ import annotations

import pytest

from gpupoor import cpu, decisions, hardware
from gpupoor.decisions import MIN_BF16_SPEEDUP, CpuBf16
from gpupoor.errors import UserError

AMX = CpuBf16("AMX bf16", 7.6)


def test_auto_trains_in_bf16_where_the_units_measure_faster_and_in_fp32_elsewhere():
    chosen = decisions.choose_precision("auto", "cpu", None, AMX)
    assert (chosen.value, chosen.reason) == ("bf16", "CPU has AMX bf16: bf16 matmuls 7.6x fp32") and not chosen.warning
    slow_units = decisions.choose_precision("auto", "cpu", None, CpuBf16("AVX-512 bf16", MIN_BF16_SPEEDUP - 0.2))
    assert slow_units.value == "fp32" and "measured only 1.3x fp32" in slow_units.reason
    none = decisions.choose_precision("auto", "cpu", None, CpuBf16("", 0.02))
    assert (none.value, none.reason) == ("fp32", "CPU has no bf16 matrix units: fp32")
    # unmeasured (plan, several processes): the flags decide
    assert decisions.choose_precision("auto", "cpu", None, CpuBf16("AMX bf16")).value == "bf16"
    assert decisions.choose_precision("auto", "cpu", None).value == "fp32"


def test_explicit_precisions_stand_and_bf16_without_units_warns_with_the_measured_cost():
    assert decisions.choose_precision("fp32", "cpu", None, AMX).value == "fp32"
    with_units = decisions.choose_precision("bf16", "cpu", None, AMX)
    assert with_units.value == "bf16" and not with_units.warning
    emulated = decisions.choose_precision("bf16", "cpu", None, CpuBf16("", 0.02))
    assert emulated.value == "bf16"
    assert "measured 50.0x slower than fp32" in emulated.warning and "precision: fp32" in emulated.warning
    with pytest.raises(UserError, match="precision = 'fp16' needs a CUDA GPU") as fp16:
        decisions.choose_precision("fp16", "cpu", None, AMX)
    assert "bf16" in fp16.value.hint


def test_inference_on_a_cpu_follows_the_units_not_the_runs_precision():
    assert decisions.choose_inference_precision("cpu", "fp32", None, AMX).value == "bf16"
    assert decisions.choose_inference_precision("cpu", "bf16", None, CpuBf16("", 0.02)).value == "fp32"
    assert decisions.choose_inference_precision("cuda", "bf16", 7).value == "fp16"
    assert decisions.choose_inference_precision("cuda", "fp32", 9).value == "fp32"


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
"""


def test_the_units_are_read_from_the_cpus_flags(tmp_path):
    assert cpu.bf16_units(cpu.cpu_flags(CPUINFO)) == "AMX bf16"
    assert cpu.bf16_units({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512 bf16"
    assert cpu.bf16_units(cpu.cpu_flags("Features\t: fp asimd sve bf16 i8mm\n")) == "Arm bf16 (BFMMLA)"
    assert cpu.bf16_units(cpu.cpu_flags("flags\t: fpu sse2 avx2 fma\n")) == ""
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert cpu.this_cpus_bf16_units(info) == "AMX bf16"
    assert cpu.this_cpus_bf16_units(tmp_path / "absent") == ""  # not Linux: no units known


@pytest.mark.parametrize("value, facts", [("none", CpuBf16("", None)), ("none:0.02", CpuBf16("", 0.02)),
                                          ("AMX bf16:7.5", CpuBf16("AMX bf16", 7.5)),
                                          ("AVX-512 bf16", CpuBf16("AVX-512 bf16", None)),
                                          ("amx_bf16", CpuBf16("AMX bf16", None)),
                                          ("false", CpuBf16("", None)), ("0", CpuBf16("", None)),
                                          ("OFF", CpuBf16("", None)), ("no:0.1", CpuBf16("", 0.1))])
def test_the_pin_gives_the_facts(value, facts):
    assert cpu.pinned_bf16({cpu.PIN_VARIABLE: value}) == facts


@pytest.mark.parametrize("value", ["AMX:fast", "AMX bf16:-1", ":7", "AMX bf16:inf", "AMX bf16:nan", "AMX bf16:0",
                                   "yes", "disabled", "AMX", "AMX bf16x"])
def test_a_bad_pin_is_refused_naming_the_variable(value):
    """A word that is neither off nor a known units name is refused: `false` was read as the name of bf16 units,
    and `precision: auto` trained in bf16 on a CPU without them."""
    with pytest.raises(UserError, match=cpu.PIN_VARIABLE) as info:
        cpu.pinned_bf16({cpu.PIN_VARIABLE: value})
    assert "'AMX bf16'" in str(info.value) and "none" in str(info.value)


def test_training_measures_only_where_a_choice_rests_on_it(monkeypatch):
    """The probe runs for auto on a CPU with units and for bf16 on one without (its warning); never when pinned,
    for fp32, or when told not to measure (several processes)."""
    probes = []
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", lambda *args, **kwargs: probes.append(args) or 3.0)
    monkeypatch.delenv(cpu.PIN_VARIABLE)
    for units, requested, measured in (("AMX bf16", "auto", True), ("AMX bf16", "bf16", False),
                                       ("AMX bf16", "fp32", False), ("", "auto", False), ("", "bf16", True)):
        monkeypatch.setattr(cpu, "this_cpus_bf16_units", lambda units=units: units)
        probes.clear()
        facts = hardware.cpu_bf16(requested, dims=lambda: (2048, 5632))
        assert (facts.speedup == 3.0) == measured and bool(probes) == measured, (units, requested)
        assert probes in ([], [(2048, 5632)])  # the model's own shapes
        assert hardware.cpu_bf16(requested, measure=False).speedup is None
    monkeypatch.setenv(cpu.PIN_VARIABLE, "AMX bf16:7.5")
    probes.clear()
    assert hardware.resolve_precision("auto", "cpu")[0].reason == "CPU has AMX bf16: bf16 matmuls 7.5x fp32"
    assert not probes


def test_a_small_models_probe_is_at_least_a_half_billion_models_matmul(monkeypatch):
    """A tiny model's matmul times call overhead, not the bf16 units: the probe's shapes are floored at PROBE_DIMS,
    so the same recipe gets the same precision run after run."""
    probes = []
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", lambda *args, **kwargs: probes.append(args) or 3.0)
    monkeypatch.delenv(cpu.PIN_VARIABLE)
    monkeypatch.setattr(cpu, "this_cpus_bf16_units", lambda: "AMX bf16")
    hardware.cpu_bf16("auto", dims=lambda: (64, 176))
    hardware.cpu_bf16("auto", dims=lambda: (576, 4096))
    assert probes == [hardware.PROBE_DIMS, (hardware.PROBE_DIMS[0], 4096)]


def test_the_probe_measures_this_cpu(monkeypatch):
    """The real probe (a few milliseconds here) and the real decision on this machine's own flags."""
    monkeypatch.delenv(cpu.PIN_VARIABLE)
    speedup = hardware.bf16_matmul_speedup(64, 128, rows=16)
    assert speedup > 0
    chosen, facts = hardware.resolve_precision("auto", "cpu", dims=lambda: (64, 128))
    if not cpu.this_cpus_bf16_units():
        assert chosen.value == "fp32" and facts.speedup is None  # no units: nothing to measure
    else:
        assert facts.speedup is not None and chosen.value == ("bf16" if facts.speedup >= MIN_BF16_SPEEDUP else "fp32")


def test_a_resume_on_the_cpu_keeps_the_precision_auto_chose_at_the_start():
    kept = decisions.choose_resumed_precision("auto", "cpu", "bf16", "cpu")
    assert kept.value == "bf16" and "a resume keeps it" in kept.reason
    assert decisions.choose_resumed_precision("fp32", "cpu", "bf16", "cpu").value == "fp32"  # an explicit change stands
    assert decisions.choose_resumed_precision("auto", "cuda", "bf16", "cuda").value == "auto"  # a GPU decides again
    assert decisions.choose_resumed_precision("auto", "cpu", None, None).value == "auto"  # a new run


def test_the_fused_layers_compute_in_bf16_on_any_device_and_not_in_fp16():
    """On an H100 the bf16 fused MLP made a 1.5B LoRA step 0.289 s against 0.343 s, at 18.9 against 29.4 GiB."""
    for device in ("cpu", "cuda"):
        assert decisions.choose_fused_paths(True, "llama", "lora", 0.0, None, "bf16", "sdpa", device).mlp
    fp16 = decisions.choose_fused_paths(True, "llama", "lora", 0.0, None, "fp16", "sdpa", "cuda")
    assert not fp16.mlp and "fp16 weights under fp32 adapters" in fp16.reason


def test_attention_per_packed_example_runs_on_a_cpu_only():
    """On an H100 the per-example loop made a 1.5B LoRA step 1.29 s against 0.34 s for one masked sdpa call."""
    for precision in ("fp32", "bf16"):
        on_gpu = decisions.choose_fused_paths(True, "qwen2", "lora", 0.0, None, precision, "sdpa", "cuda")
        assert not on_gpu.attention and "faster on a GPU" in on_gpu.reason
    assert decisions.choose_fused_paths(True, "qwen2", "lora", 0.0, None, "fp32", "sdpa", "cuda").mlp
    assert decisions.choose_fused_paths(True, "qwen2", "lora", 0.0, None, "fp32", "sdpa", "cpu").attention


def test_a_resume_decides_again_where_the_checkpoint_came_from_a_gpu():
    assert decisions.choose_resumed_precision("auto", "cpu", "bf16", trained_on="cuda").value == "auto"


def test_multiple_processes_warn_of_emulated_bf16_on_the_flags_alone():
    unmeasured = decisions.choose_precision("bf16", "cpu", None, CpuBf16(""))
    assert unmeasured.value == "bf16" and "emulated" in unmeasured.warning
