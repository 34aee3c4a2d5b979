"""Fault injection for tests: `GPUPOOR_FAULT=ACTION@WHERE[,ACTION@WHERE...]` makes a process fail exactly
where only a real crash would, so tests can prove that nothing is lost.

- `kill@STAGE` or `kill@STAGE:STEP`: SIGKILL this process at a stage of the checkpoint commit protocol (see
  checkpoint.STAGES), in every save or only in the save of optimizer step STEP.
- `enospc@STAGE[:STEP]`: raise "No space left on device" there instead.
- `nan@STEP`: make the loss of optimizer step STEP non-finite.
- `sigterm@STEP`: send this process SIGTERM right after optimizer step STEP (a preemption at a known step).
- `sigterm@startup`: SIGTERM once the model is built, before the first step; `sigterm@stopped`: SIGTERM after the
  stop checkpoint is committed, while the process winds down (a scheduler's repeated signal).

Unset in normal use; reading one environment variable costs nothing.
"""

from __future__ import annotations

import errno
import os
import signal


def _faults() -> list[tuple[str, str]]:
    spec = os.environ.get("GPUPOOR_FAULT", "")
    return [tuple(item.split("@", 1)) for item in spec.split(",") if "@" in item]  # type: ignore[misc]


def at_stage(stage: str, step: int | None = None) -> None:
    for action, where in _faults():
        if where not in (stage, f"{stage}:{step}"):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(injected at {stage})")


def steps_for(action: str) -> set[int]:
    return {int(where) for name, where in _faults() if name == action and where.isdigit()}


def after_step(step: int) -> None:
    if step in steps_for("sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
