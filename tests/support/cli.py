"""Shared by the cli tests (moved from unit/test_cli.py, whose tests still use them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from typer.testing import CliRunner


runner = CliRunner()


def invoke(*args, monkeypatch=None, fault: str | None = None):
    """`gpupoor ARGS` in this process (typer's CliRunner), with GPUPOOR_FAULT set to `fault` (or cleared) when a
    monkeypatch is given."""
    from typer.testing import CliRunner

    from gpupoor.cli import app

    if monkeypatch is not None:
        if fault:
            monkeypatch.setenv("GPUPOOR_FAULT", fault)
        else:
            monkeypatch.delenv("GPUPOOR_FAULT", raising=False)
    return CliRunner().invoke(app, [str(a) for a in args])


def run_cli(args: list, env_extra: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`gpupoor ARGS` in a process of its own (python -m gpupoor), its output captured."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "gpupoor", *map(str, args)], env=env, capture_output=True,
                          text=True, **{"timeout": 300, **kwargs})


def signalled_once(command: list, ready: Callable[[], bool], signum: int, env_extra: dict | None = None,
                   poll_s: float = 0.1) -> subprocess.CompletedProcess:
    """`command` in a process of its own, sent `signum` as soon as `ready()` holds (a step or a checkpoint on
    disk: never after a sleep, so a slow machine only waits longer), then waited for; its exit code and output.
    Fails if the process ends before `ready()` holds; the 10-minute bound only ends a hung run."""
    process = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env_extra or {})})
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(poll_s)
        process.send_signal(signum)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
