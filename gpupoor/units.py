"""Sizes and durations, read from people and written for them: the one parser and one formatter of each.

A leaf: imports nothing of gpupoor's but its errors, and no torch, so the recipe schema, `plan`, `status` and the
CLI all read `10GiB` or `11h30m` the same way, and a value that validates is a value that works.
"""

from __future__ import annotations

import math
import re

from gpupoor.errors import UserError

MiB = 2**20
GiB = 2**30

SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MAX_DURATION_S = 365 * 24 * 3600.0
MAX_SIZE = 2**50  # 1 PiB
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*((?:[KMGT]I?)?B)?\s*")
_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$")


def parse_size(text: str, option: str = "size") -> int:
    """'4GiB' -> 4 * 2**30 bytes, '2GB' -> 2 * 10**9 (case-insensitive; a bare number is bytes). `option` names
    the setting in the error, e.g. 'memory.max_gpu_memory' or '--memory'."""
    match = _SIZE.fullmatch(str(text).upper())
    if not match:
        raise UserError(f"{option} {text!r}: use a size like 2GB, 500MB or 4GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B")
    if not math.isfinite(number * SIZE_UNITS[unit]) or number * SIZE_UNITS[unit] > MAX_SIZE:
        raise UserError(f"{option} {text!r}: more than any machine has (the most taken is 1 PiB)",
                        hint="give a size like 2GB, 500MB or 4GiB")
    return int(number * SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    """'11h30m' -> 41400.0 seconds. A bare number means seconds. Raises ValueError (the schema's validators
    turn it into a message at the recipe key)."""
    text = str(text)
    try:
        total = float(text)
    except ValueError:
        match = _DURATION.match(text)
        if not match or not any(match.groups()):
            raise ValueError(f"not a duration: {text!r}; use e.g. 11h30m, 45m or 90s") from None
        hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
        total = hours * 3600 + minutes * 60 + seconds
    # inf, nan and 1e400 parse as floats; a limit of a year or more is no limit a session has (and overflows the
    # dates a plan prints)
    if not math.isfinite(total) or total > MAX_DURATION_S:
        raise ValueError(f"not a duration a session can have: {text!r}; use one under a year, e.g. 11h30m")
    return total


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def format_bytes_apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` in one unit (format_bytes' for the larger), with as many decimals as it takes for two sizes that
    differ to read differently: a disk short by 3 MiB of 1 GiB is "1.003 GiB needed, 1.000 GiB free", never
    "1.00 GiB needed, 1.00 GiB free"; past a GiB's billionth, in bytes."""
    unit, name, digits = (GiB, "GiB", 2) if max(abs(a), abs(b)) >= GiB else (MiB, "MiB", 0)
    for places in range(digits, 10):
        apart = f"{a / unit:.{places}f} {name}", f"{b / unit:.{places}f} {name}"
        if apart[0] != apart[1] or a == b:
            return apart
    return f"{int(a):,} bytes", f"{int(b):,} bytes"


def format_duration(seconds: float, style: str = "clock") -> str:
    """`clock` (a countdown, e.g. an ETA): 0:07, 12:34, 1:02:03. `age` (how long ago, how long left): 45s
    under two minutes, 17m under two hours, then 3h05m."""
    if style == "clock":
        seconds = int(max(0, seconds))
        hours, rest = divmod(seconds, 3600)
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
    if style == "age":
        seconds = int(seconds)
        if seconds < 120:
            return f"{seconds}s"
        if seconds < 7200:
            return f"{seconds // 60}m"
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    raise ValueError(f"format_duration: style {style!r} is not clock or age")


class ProgressLine:
    """Progress through a long wait as plain lines a log keeps: `LABEL: 120/272 tensors, 14 s, about 18 s left`,
    at most one every `every_s` seconds (and the last), so a minute of silence never looks like a hang."""

    def __init__(self, total: int, say, label: str, unit: str, every_s: float = 10.0, clock=None):
        import time

        self.total, self.say, self.label, self.unit, self.every_s = total, say, label, unit, every_s
        self.clock = clock or time.monotonic
        self.started = self.said = self.clock()
        self.done = 0

    def tick(self, count: int = 1) -> None:
        self.done += count
        now = self.clock()
        if now - self.said < self.every_s and self.done < self.total:
            return
        self.said = now
        spent = now - self.started
        left = f", about {format_duration(spent / self.done * (self.total - self.done), 'age')} left" \
            if 0 < self.done < self.total else ""
        self.say(f"{self.label}: {self.done}/{self.total} {self.unit}, {format_duration(spent, 'age')}{left}")
