"""Checkpoints during a run: when to save (CheckpointPolicy), and the save itself (CheckpointSaver), collective
with several processes: every process agrees whether a save is due, sends its share, and learns whether the
checkpoint landed, so that a failure on one stops them all at the same point with the same error."""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpupoor.errors import RunFailed
from gpupoor.run.session import Session


ASSUMED_WRITE_BYTES_PER_S = 100 * 2**20  # save-time guess until the first checkpoint is measured
MIN_SAVE_RESERVE_S = 1.0  # a save also writes the tokenizer and fsyncs: never assume less than this


@dataclass(kw_only=True)
class CheckpointPolicy:
    """When to save (every N steps, every M minutes), how long a save takes (measured, or guessed from its
    size), and so how much time a time limit must keep in reserve to land the last checkpoint."""

    every_steps: int | None
    interval_minutes: float | None
    time_limit_s: float | None
    started: float  # time.monotonic() when the command began
    expected_bytes: int  # size of the next checkpoint (measured after the first)
    last_time: float = field(default_factory=time.monotonic)
    last_step: int = 0
    save_s: float = 0.0  # seconds the last save took (0: none yet)

    def due(self, step: int, total_steps: int) -> bool:
        if step >= total_steps:
            return False  # the end of the run saves anyway
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        by_time = bool(self.interval_minutes) and time.monotonic() - self.last_time >= 60 * self.interval_minutes
        return by_steps or by_time

    def saved(self, step: int, seconds: float | None, size: int | None) -> None:
        if seconds is not None:
            self.save_s = seconds
        if size is not None:
            self.expected_bytes = size
        self.last_time, self.last_step = time.monotonic(), step

    def out_of_time(self, last_step_s: float) -> bool:
        """Keep twice the save time plus one step in reserve, so the checkpoint lands before the deadline."""
        if self.time_limit_s is None:
            return False
        save_s = self.save_s or max(MIN_SAVE_RESERVE_S, self.expected_bytes / ASSUMED_WRITE_BYTES_PER_S)
        return time.monotonic() - self.started + 2 * save_s + last_step_s >= self.time_limit_s


def best_checkpoint(session: Session) -> str | None:
    """The checkpoint of the best eval so far when checkpoint.keep_best keeps it (rotation spares it), else None."""
    state = session.state
    keep = session.recipe.checkpoint.keep_best and state.best_step is not None
    return f"step-{state.best_step:06d}" if keep else None


class CheckpointSaver:
    """Commits checkpoints/step-N (and, for _finish, says why final/ failed) for every process together.
    `report`: the run's Reporter (the last loss for the manifest; where records and warnings go); `stop`: the
    command's StopRequest, marked finished when a failed save ends the run."""

    def __init__(self, session: Session, policy: CheckpointPolicy, *, report, stop, manifest_base: dict):
        self.session, self.policy, self.report, self.stop = session, policy, report, stop
        self.manifest_base = manifest_base
        self._rngs = None

    def save(self) -> str:
        """Commit checkpoints/step-N for the current state; rotate older ones. Returns its name.

        With several processes the collective part comes first (FSDP: every process sends its share of the
        weights to the first and writes its own shard of the optimizer state into a staging folder), then the
        first process alone commits the checkpoint (weights, optimizer, progress, manifest last, one rename), and
        all processes learn whether it landed: a failure stops every process, not only the one that saw it."""
        from gpupoor.storage.checkpoint import CheckpointError, write_checkpoint
        from gpupoor.storage.files import dir_size
        from gpupoor.train.distributed import any_process, local_values, summed

        session, step = self.session, self.session.state.step
        name = f"step-{step:06d}"
        finite = all(local_values(p).isfinite().all() for p in session.unwrapped.parameters() if p.requires_grad)
        if any_process(not finite):
            raise RunFailed(f"refusing to save {name}: the trainable weights are not finite")
        gathered = session.gather_weights()
        self._rngs = self._gather_rngs()
        staged = own = None  # own: this process's error
        try:
            staged = self._stage_optimizer(name)
        except Exception as exc:  # DCP raises on every process (distributed.dcp_error); other writes fail alone
            own = exc
        if any_process(own is not None):  # before any further collective: every process stops here
            if session.main:
                shutil.rmtree(self._staging(name), ignore_errors=True)  # every process is done writing into it
            raise self.failed(session.checkpoints_dir / name, own)
        seconds = size = None
        if session.main:
            try:
                seconds = write_checkpoint(session.checkpoints_dir / name,
                                           functools.partial(self._save_files, gathered=gathered, staged=staged),
                                           step, {**self.manifest_base, "loss": self.report.last_loss},
                                           int(self.policy.expected_bytes * 1.1) - (dir_size(staged) if staged else 0))
                size = dir_size(session.checkpoints_dir / name)
            except Exception as exc:  # the others must learn of it below, or they would wait for it forever
                own = exc
            else:
                self._rotate(step)
            finally:
                if staged is not None:
                    shutil.rmtree(staged, ignore_errors=True)  # moved into the checkpoint, or abandoned
        # Whether it landed, and its size from the first process: every process estimates the next save alike.
        failed, size = summed(float(own is not None), float(size or 0))
        if failed:
            failure = self.failed(session.checkpoints_dir / name, own)  # collective: every process, first
            if own is not None and not isinstance(own, (CheckpointError, OSError)):
                raise own  # a bug, not the disk: the first process reports it as it is (--debug: the traceback)
            raise failure
        self.policy.saved(step, seconds, int(size))
        self.report.write({"step": step, "checkpoint": name, "save_s": round(self.policy.save_s, 3)})
        return name

    def _rotate(self, step: int) -> None:
        """Remove checkpoints beyond keep_last. The new one has landed, so a failure here (a file that cannot be
        removed) costs disk space, not work: a warning, never a failed save."""
        from gpupoor.storage.checkpoint import rotate

        try:
            rotate(self.session.checkpoints_dir, self.session.recipe.checkpoint.keep_last, step,
                   keep=best_checkpoint(self.session))
        except OSError as exc:
            self.report.message(f"warning: could not remove an old checkpoint ({exc}); the new one landed: "
                                  "remove the old one by hand to free its space", always=True)

    def failed(self, target: Path, error: Exception | None) -> RunFailed:
        """Writing `target` (a checkpoint, final/) failed on some process, as every process agreed: the same
        one-line error for all, the first failing process's (gathered), after which none enters a collective."""
        text = self._failure_text(target, error) if error is not None else None
        processes = self.session.accelerator.num_processes
        if processes > 1:
            import torch.distributed as dist

            texts: list = [None] * processes
            dist.all_gather_object(texts, text)
            text = next(text for text in texts if text is not None)
        # Like a finished run, each process exits with its own code (1) instead of dying of the SIGTERM a launcher
        # sends the others when the first one exits.
        self.stop.finished = True
        return RunFailed(text)

    def _failure_text(self, target: Path, error: Exception) -> str:
        """A failed save in one line: a full disk with where, what the checkpoint needs and what is free; another
        error as it was (an OSError names its path)."""
        from gpupoor.storage.checkpoint import CheckpointError, disk_full, is_disk_full

        run_dir = self.session.run_dir
        if is_disk_full(error):
            error = disk_full(target, int(self.policy.expected_bytes * 1.1))
        if isinstance(error, CheckpointError):  # the disk: its text says what was needed and that nothing was lost
            return f"{error}\n  free some space, then continue with: gpupoor resume {run_dir}"
        return (f"could not write {target.relative_to(run_dir)}: {error}\n  the previous checkpoint is intact; "
                f"continue with: gpupoor resume {run_dir}")

    def _gather_rngs(self) -> list | None:
        """Several processes: every process's RNG state and GRPO rollout, by rank (each draws its own dropout masks
        and samples its own answers, so each resumes its own). Collective."""
        accelerator = self.session.accelerator
        if accelerator.num_processes == 1:
            return None
        import torch.distributed as dist

        from gpupoor.train.state import capture_rng

        states: list = [None] * accelerator.num_processes
        dist.all_gather_object(states, {"rng": capture_rng(), "rollout": self.session.state.rollout})
        return states

    def _stage_optimizer(self, name: str) -> Path | None:
        """FSDP: every process writes its shard of the optimizer state into a staging folder beside the
        checkpoints (removed by the next resume's sweep if a crash leaves it). None otherwise."""
        from gpupoor import faults

        session, step = self.session, self.session.state.step
        if not session.sharded:
            faults.at_stage("gathered", step)
            return None
        from gpupoor.train.distributed import save_optimizer

        staged = self._staging(name)
        # The fault point is where a process's own write begins, inside DCP, which agrees on failures itself.
        save_optimizer(session.model, session.raw_optimizer, staged, session.main,
                       before_write=lambda: faults.at_stage("gathered", step))
        return staged

    def _staging(self, name: str) -> Path:
        from gpupoor.storage.checkpoint import TMP_PREFIX

        return self.session.checkpoints_dir / f"{TMP_PREFIX}{name}-optimizer-shards"

    def _save_files(self, tmp: Path, gathered: dict | None = None, staged: Path | None = None) -> None:
        import torch

        from gpupoor import faults
        from gpupoor.storage.checkpoint import STATE
        from gpupoor.train.distributed import DCP_OPTIMIZER, TORCH_OPTIMIZER
        from gpupoor.train.state import capture_rng

        session, step = self.session, self.session.state.step
        session.save_weights(tmp, gathered)
        faults.at_stage("weights", step)
        if staged is not None:
            os.rename(staged, tmp / DCP_OPTIMIZER)  # the same filesystem: the shards move, nothing is copied
        else:
            torch.save(session.optimizer.state_dict(), tmp / TORCH_OPTIMIZER)
        if session.accelerator.scaler is not None:
            torch.save(session.accelerator.scaler.state_dict(), tmp / "scaler.pt")
        faults.at_stage("optimizer", step)
        session.state.rng = capture_rng()
        session.state.rng_by_rank = [each["rng"] for each in self._rngs or []]
        session.state.rollout_by_rank = [each["rollout"] for each in self._rngs or []]
        (tmp / STATE).write_text(json.dumps(session.state.to_dict()))
        faults.at_stage("state", step)
