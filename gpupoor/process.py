"""This process: whether it was started for one gpupoor command, and how old it is. The start-up clock
(gpupoor.run.startup) and the time plan (a `plan`'s own start is what a `train` spends before its clock) read
it; no dependencies."""

from __future__ import annotations

import os

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
