"""Where the seconds before the first optimizer step go: the startup summary's "ready in" line and the
`startup_s` of metrics.jsonl's start record (docs/watching.md). Plain wall-clock marks, no dependencies."""

from __future__ import annotations

import os
import time

_whole_process = False  # set by the command line: the process started for this one command


def started_by_command_line() -> None:
    """The process runs one gpupoor command (cli.main): its age is start-up time. (A test session or a Python
    program calling gpupoor has lived longer than any run; its age is not counted.)"""
    global _whole_process
    _whole_process = True


def from_command_line() -> bool:
    """True in a process started for one gpupoor command (not a test session or a program calling gpupoor)."""
    return _whole_process


def process_age_s() -> float | None:
    """Seconds since this process started (Python's own start-up included), or None where /proc cannot say."""
    try:
        with open("/proc/self/stat") as stat:
            # The fields after the command name (which may hold spaces); starttime is the 22nd field overall.
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            now_s = float(uptime.read().split()[0])
        return max(0.0, now_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Seconds per start-up part, in order. From the command line, the first part ("python and cli": the
    interpreter, the command line, the recipe's checks and memory plan) runs from the process's start to the
    clock's creation."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        age = process_age_s() if _whole_process else None
        if age is not None:
            self.parts["python and cli"] = age
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        """The time since the previous mark belongs to `part` (added up when a part is marked twice)."""
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now

    def seconds(self) -> dict[str, float]:
        return {part: round(seconds, 3) for part, seconds in self.parts.items()}

    def line(self) -> str:
        total = sum(self.parts.values())
        return f"ready in {total:.1f} s (" + ", ".join(f"{part} {s:.2f}" for part, s in self.parts.items()) + ")"
