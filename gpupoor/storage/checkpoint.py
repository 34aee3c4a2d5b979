"""Checkpoints that survive any crash.

Commit protocol: write into a temporary directory beside the target (same filesystem), fsync every file,
write the manifest last (step, size and sha256 of each file, recipe hash, data fingerprint, versions), rename
into place, fsync the parent. A reader sees no checkpoint or a whole one. Checkpoints are chosen by the
manifest's step after verifying it, never by mtime or name; rotation runs only after a commit and never
removes the newest valid checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from gpupoor import faults
from gpupoor.errors import UserError
from gpupoor.storage.files import atomic_dir, sha256_file
from gpupoor.storage.shards import MODEL_INDEX, SINGLE_FILE, indexed_shards

MANIFEST = "manifest.json"
STATE = "train_state.json"
ADAPTER = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
# What a reader needs, by kind of directory. A manifest that does not list each of these is not valid, however
# well-formed: a run resumes from a checkpoint, merge-lora and generate read final/ or a checkpoint. The weights
# are an adapter (peft methods) or the whole model (`full`: config.json and its safetensors shards); the
# manifest's "weights" says which.
TRAINING_FILES = ("optimizer.pt", STATE)
# Under FSDP the optimizer state is DCP's shards in optimizer/; its .metadata names every shard file.
SHARDED_TRAINING_FILES = ("optimizer/.metadata", "optimizer/param_groups.json", STATE)
ADAPTER_FILES = (ADAPTER, ADAPTER_CONFIG)
TMP_PREFIX = ".tmp-"
# Stages of the commit protocol, in order; fault injection (GPUPOOR_FAULT=kill@STAGE) can stop at each.
STAGES = ("start", "weights", "optimizer", "state", "manifest", "rename", "rotate")


class CheckpointError(Exception):
    """A checkpoint could not be written; the previous one is intact."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    manifest: dict


def write_checkpoint(target: Path, save_files, step: int, manifest_extra: dict, expected_bytes: int) -> float:
    """Atomically create `target` with what `save_files(tmp_dir)` writes, plus its manifest. Returns the
    seconds it took. Raises CheckpointError (disk full, before or during the write) with the previous
    checkpoint untouched."""
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < expected_bytes:
        raise CheckpointError(f"not enough disk space for checkpoint {target.name}: needs about "
                              f"{_mb(expected_bytes)}, {_mb(free)} free on {target.parent}")
    try:
        faults.at_stage("start", step)
        with atomic_dir(target, f"{TMP_PREFIX}{target.name}-{os.getpid()}") as tmp:
            save_files(tmp)  # calls faults.at_stage for weights / optimizer / state
            files = {str(path.relative_to(tmp)): {"size": path.stat().st_size, "sha256": sha256_file(path)}
                     for path in sorted(p for p in tmp.rglob("*") if p.is_file())}
            faults.at_stage("manifest", step)
            manifest = {"step": step, "files": files, "created": time.time(), **manifest_extra}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: its presence means complete
            faults.at_stage("rename", step)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full(target, expected_bytes) from None
        raise
    return time.perf_counter() - started


def is_disk_full(error: BaseException | None) -> bool:
    """A full disk or quota, however the library writing said it (storage.files.ran_out_of_space)."""
    from gpupoor.storage.files import ran_out_of_space

    return error is not None and ran_out_of_space(error)


def disk_full(target: Path, expected_bytes: int) -> CheckpointError:
    """The error of a checkpoint write that ran out of space (its partial files already removed): where, what the
    whole checkpoint needs, what is free now."""
    try:
        free = f"{_mb(shutil.disk_usage(target.parent).free)} free"
    except OSError:
        free = "free space unknown"
    return CheckpointError(f"disk full while writing checkpoint {target.name}: it needs about {_mb(expected_bytes)} "
                           f"on {target.parent} ({free}); the partial checkpoint was removed and the previous one "
                           "is intact")


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def read_manifest(path: Path) -> dict:
    """The manifest of a checkpoint or adapter directory, {} when it has none (e.g. a plain PEFT adapter)."""
    manifest = path / MANIFEST
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def required_files(manifest: dict, path: Path, training: bool) -> tuple[str, ...]:
    """The files a directory with this manifest must list: its weights (an adapter, or a model's config and
    every safetensors shard its index names), plus the training state of a checkpoint (optimizer.pt, or under
    FSDP the DCP metadata of the optimizer's shards)."""
    # A built-in model (gpupoor.model.builtin: {"builtin": NAME}) is a whole model too, written before manifests
    # said "weights"; read as an adapter's, its manifest would be said to lack adapter files.
    if manifest.get("weights") == "model" or "builtin" in manifest:
        if MODEL_INDEX in manifest["files"] and (path / MODEL_INDEX).is_file():
            try:
                shards = tuple(indexed_shards(path) or ())
            except ValueError:
                shards = (MODEL_INDEX + " (readable)",)  # listed, so its hash check names it as corrupt
            weights = (MODEL_CONFIG, MODEL_INDEX) + shards
        else:
            weights = (MODEL_CONFIG, SINGLE_FILE)
    else:
        weights = ADAPTER_FILES
    if not training:
        return weights
    if manifest.get("optimizer") == "dcp":
        return weights + SHARDED_TRAINING_FILES  # the shards DCP wrote are listed (and hashed) beside it
    return weights + TRAINING_FILES


def verify(path: Path, required: tuple[str, ...] | None = None, training: bool = True) -> str | None:
    """None when the checkpoint (`training`: with its optimizer and progress) or final/ is complete and intact,
    else why not: the manifest must list every required file (by default, what `required_files` says), and every
    listed file must match its size and hash."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
        if not all(isinstance(meta, dict) and isinstance(meta.get("size"), int) and isinstance(meta.get("sha256"), str)
                   for meta in files.values()):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "unreadable manifest"
    if required is None:
        required = required_files(manifest, path, training)
    unlisted = [name for name in required if name not in files]
    if unlisted:
        return f"its manifest does not list {', '.join(unlisted)}"
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != meta["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {meta['size']}"
        if sha256_file(file) != meta["sha256"]:
            return f"{name} is corrupt (sha256 mismatch)"
    return None


def scan(checkpoints_dir: Path, check_files: bool = True) -> list[tuple[Path, int | None, str | None]]:
    """Every checkpoint directory as (path, step or None, problem or None), newest step first. With
    check_files=False only the manifest is read (no hashing): enough to order committed checkpoints."""
    found = []
    if checkpoints_dir.is_dir():
        for path in checkpoints_dir.iterdir():
            if not path.is_dir() or path.name.startswith(TMP_PREFIX):
                continue
            problem = verify(path) if check_files else _manifest_problem(path)
            step = json.loads((path / MANIFEST).read_text())["step"] if problem is None else None
            found.append((path, step, problem))
    return sorted(found, key=lambda item: (item[1] is not None, item[1] or 0), reverse=True)


def _manifest_problem(path: Path) -> str | None:
    try:
        int(json.loads((path / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest"
    return None


def latest_valid(checkpoints_dir: Path, warn=print, check=None) -> Checkpoint | None:
    """The verified checkpoint with the highest manifest step; invalid ones are skipped with a warning.
    `check(path)`: a further problem of an intact checkpoint, or None (resume: can its optimizer state load?)."""
    best = None
    for path, step, problem in scan(checkpoints_dir):
        if problem is None and check is not None:
            problem = check(path)
        if problem is not None:
            warn(f"warning: skipping checkpoint {path.name}: {problem}")
        elif best is None or step > best.step:
            best = Checkpoint(path, step, json.loads((path / MANIFEST).read_text()))
    return best


def sweep_temporary(checkpoints_dir: Path) -> list[str]:
    """Remove temporary directories left by a crash mid-write. Returns their names."""
    removed = []
    for parent in (checkpoints_dir, checkpoints_dir.parent):
        if parent.is_dir():
            for path in parent.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    return removed


def rotate(checkpoints_dir: Path, keep_last: int, step: int | None = None, keep: str | None = None) -> list[str]:
    """Keep the `keep_last` newest valid checkpoints (by manifest step) and remove older valid ones. Never
    removes the newest valid checkpoint, nor `keep` (the best by eval loss); leaves invalid ones for the user
    to inspect (resume skips them)."""
    faults.at_stage("rotate", step)
    # Manifests only: the newest was verified as it was written, and rehashing every kept checkpoint on
    # every save would cost more than the save.
    valid = [path for path, _, problem in scan(checkpoints_dir, check_files=False) if problem is None]
    removed = []
    for path in valid[max(1, keep_last):]:
        if path.name == keep:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def load_torch(path: Path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def final_problem(run_dir: Path) -> str | None:
    """None when the run's final/ adapter is complete and intact, else why not ("absent" when there is none)."""
    final = run_dir / "final"
    return verify(final, training=False) if final.exists() else "absent"


def verify_weights_dir(path: Path, skip: bool = False, in_run: bool = False) -> None:
    """Raise a UserError naming the file when a weights directory gpupoor wrote (an adapter or a full model's
    shards: final/ or a checkpoint of a run, or a copy with its manifest) does not match its manifest. A plain PEFT
    adapter or model directory elsewhere has no manifest: nothing to check. `skip`: the user edited the files on
    purpose."""
    if skip or (not in_run and not (path / MANIFEST).is_file()):
        return
    problem = verify(path, training=False)
    if problem is not None:
        raise UserError(f"{path}: {problem}; gpupoor does not use files that differ from what it wrote",
                        hint="restore the file or pick another checkpoint (--checkpoint step-N); for a run dir, "
                        "`gpupoor resume RUN_DIR` writes final/ again from its last checkpoint; merge-lora "
                        "--skip-manifest-check merges files you changed on purpose")
