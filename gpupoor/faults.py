"""Fault injection for tests: `GPUPOOR_FAULT=ACTION@WHERE[,ACTION@WHERE...]` makes a process fail exactly
where only a real crash would, so tests can prove that nothing is lost.

- `kill@STAGE` or `kill@STAGE:STEP`: SIGKILL this process at a stage of the checkpoint commit protocol (see
  checkpoint.STAGES), in every save or only in the save of optimizer step STEP.
- `enospc@STAGE[:STEP]`: raise "No space left on device" there instead.
- `nan@STEP`: make the loss of optimizer step STEP non-finite.
- `sigterm@STEP`: send this process SIGTERM right after optimizer step STEP (a preemption at a known step).
- `sigterm@startup`: SIGTERM once the model is built, before the first step; `sigterm@stopped`: SIGTERM after the
  stop checkpoint is committed, while the process winds down (a scheduler's repeated signal); `sigterm@exiting`:
  SIGTERM once `train`/`resume` has decided its outcome (a checkpoint or final/ committed), as the process exits.
- `sigint@STEP`, `sighup@STEP`: SIGINT (Ctrl-C) or SIGHUP (a closed terminal) right after optimizer step STEP.
- `ACTION@working` (sigint, sigterm or sighup): in the other verbs, once they have begun what they write (merge-lora
  a tensor into its output, tokenize its temporary folder, eval the base's answers, serve its merge, report its
  figures, convert-recipe its recipe, plan its plan): the bad-input harness's signal cases
  (tests/system/test_harness_signals.py).
- `timeout@STEP`: this process finds its time limit reached after optimizer step STEP.
- `kill@gathered[:STEP]` (or `enospc@gathered[:STEP]`): in the middle of a save's collective part (the weights
  are gathered; FSDP: inside DCP, where this process starts writing its optimizer shard).
- `ACTION@gguf-tensor:QUANT` (kill, sigterm or enospc): in `export`, after each tensor written to the QUANT file.
- `rankN/ACTION@WHERE`: only in the process of rank N (a signal that reaches one rank, one rank that dies).

Unset in normal use; reading one environment variable costs nothing.
"""

from __future__ import annotations

import errno
import os
import signal


SIGNALS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sighup": signal.SIGHUP}


def _faults() -> list[tuple[str, str]]:
    spec = os.environ.get("GPUPOOR_FAULT", "")
    rank = os.environ.get("RANK", "0")
    faults = []
    for item in spec.split(","):
        only, _, item = item.rpartition("/")  # "rank1/sigterm@3": only the process of rank 1
        if "@" in item and only in ("", f"rank{rank}"):
            faults.append(tuple(item.split("@", 1)))
    return faults  # type: ignore[return-value]


def at_stage(stage: str, step: int | None = None) -> None:
    for action, where in _faults():
        if where not in (stage, f"{stage}:{step}"):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action in SIGNALS:
            os.kill(os.getpid(), SIGNALS[action])
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(injected at {stage})")


def steps_for(action: str) -> set[int]:
    return {int(where) for name, where in _faults() if name == action and where.isdigit()}


def after_step(step: int) -> None:
    for action, signum in SIGNALS.items():
        if step in steps_for(action):
            os.kill(os.getpid(), signum)
