"""Checkpoints written atomically: into a temporary directory beside the target, every file fsynced, a
manifest written last, then one rename. A reader sees no checkpoint or a whole one, never half of one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from gpupoor.train.state import TrainState, capture_rng

MANIFEST = "manifest.json"
STATE = "train_state.json"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checkpoint(target: Path, model, tokenizer, state: TrainState, optimizer=None, scheduler=None,
                     extra_manifest: dict | None = None) -> float:
    """Write a checkpoint directory at `target` atomically. Returns the seconds it took."""
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        model.save_pretrained(tmp, safe_serialization=True)  # adapter_config.json + adapter_model.safetensors
        tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        state.rng = capture_rng()
        (tmp / STATE).write_text(json.dumps(state.to_dict()))
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync_file(path)
            files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {"step": state.step, "files": files, **(extra_manifest or {})}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: its presence means complete
        _fsync_file(tmp / MANIFEST)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written checkpoint behind
        raise
    return time.perf_counter() - started
