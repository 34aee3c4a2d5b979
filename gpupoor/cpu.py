"""What the CPU can do with bf16 matrices, read without torch (so `gpupoor plan` can ask it too): the matrix units
its flags name. Training confirms them with a matmul probe (gpupoor.hardware.bf16_matmul_speedup) before
`gpupoor.decisions.choose_precision` picks bf16 on their word."""

from __future__ import annotations

import functools
from pathlib import Path

# Flags that name bf16 matrix units, best first, as the kernel lists them in /proc/cpuinfo: Intel's AMX tiles
# (Sapphire Rapids and later), AVX-512 BF16 dot products (Cooper Lake, AMD Zen 4 and later), Arm's BFMMLA
# (Neoverse V1 and later, Graviton 3, Apple M2: "bf16" among the Features). Without one of them torch computes a
# bf16 matmul by converting to fp32 and back: on an AVX2 EPYC 5-8x slower than fp32 through F.linear and
# 40-90x through `a @ b` (bench/cpu_bf16_cost.py, docs/benchmarks.md).
BF16_UNIT_FLAGS = (("amx_bf16", "AMX bf16"), ("avx512_bf16", "AVX-512 bf16"), ("bf16", "Arm bf16 (BFMMLA)"))


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's first processor ("flags" on x86, "Features" on Arm)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def bf16_units(flags: set[str]) -> str:
    """The bf16 matrix units these flags name, in words ("" for none)."""
    return next((name for flag, name in BF16_UNIT_FLAGS if flag in flags), "")


@functools.lru_cache(maxsize=4)
def this_cpus_bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's bf16 matrix units ("" for none, or where /proc/cpuinfo cannot be read: not Linux); read once:
    `plan --fit` resolves the recipe for every change it tries."""
    try:
        return bf16_units(cpu_flags(cpuinfo.read_text(errors="replace")))
    except OSError:
        return ""


# Pins what gpupoor takes the CPU's bf16 units to be, instead of reading its flags and measuring: "none", or the
# units' name, either with ":SPEEDUP" (the ratio of bf16 to fp32 matmul throughput). For a container or VM that
# hides the CPU's flags, and for tests that must decide the same on every CPU.
PIN_VARIABLE = "GPUPOOR_CPU_BF16"


# Words that pin "no bf16 units" (a shell's usual ways of saying off); any other units must be named as
# BF16_UNIT_FLAGS names them (or by their flag): a typo read as a units name would train in bf16 on a CPU that
# emulates it, several times slower, without a word.
OFF_WORDS = ("none", "off", "false", "no", "0")


def pinned_units(units: str) -> str | None:
    """The units' name a pinned value means ("" for none), or None when it names no known units."""
    word = units.strip().lower()
    if word in OFF_WORDS:
        return ""
    return next((name for flag, name in BF16_UNIT_FLAGS if word in (flag, name.lower())), None)


def pinned_bf16(environ=None):
    """The CpuBf16 facts GPUPOOR_CPU_BF16 pins, or None when it is unset."""
    import math
    import os

    from gpupoor.decisions import CpuBf16
    from gpupoor.errors import UserError

    value = (os.environ if environ is None else environ).get(PIN_VARIABLE, "").strip()
    if not value:
        return None
    units, _, speedup = value.rpartition(":") if ":" in value else (value, "", "")
    try:
        ratio = float(speedup) if speedup else None
    except ValueError:
        ratio = None
    name = pinned_units(units)
    if (speedup and (ratio is None or not math.isfinite(ratio) or not ratio > 0)) or name is None:
        known = ", ".join(repr(name) for _, name in BF16_UNIT_FLAGS)
        raise UserError(f"{PIN_VARIABLE}={value!r} is not 'none', 'UNITS' or 'UNITS:SPEEDUP' (UNITS one of {known}, "
                        f"or {'/'.join(OFF_WORDS)} for none; SPEEDUP a finite number above 0)",
                        hint=f"e.g. {PIN_VARIABLE}='AMX bf16:7.5' or {PIN_VARIABLE}=none:0.02, or unset it to "
                             "read the CPU's flags and measure")
    return CpuBf16(name, ratio)


def bf16_facts_from_flags():
    """The CpuBf16 facts known without measuring (what `plan` decides on): pinned, or the flags' units."""
    from gpupoor.decisions import CpuBf16

    pinned = pinned_bf16()
    return pinned if pinned is not None else CpuBf16(this_cpus_bf16_units())
