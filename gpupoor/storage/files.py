"""File-system primitives every verb needs: atomic files and directories, hashing, modes, the cache folder.

A leaf: imports nothing of gpupoor's. Atomic means a reader (or a process started after a power cut) sees the
old content or the whole new one: write beside the target on the same filesystem, fsync, rename, fsync the
folder that holds the name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it replaces `path` durably, on failure it is
    removed and `path` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; outputs get the modes open() gives
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        raise naming(exc, path)
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(target: Path, tmp_name: str) -> Iterator[Path]:
    """Yield a new temporary directory `tmp_name` beside `target` to fill; on success every file in it is
    fsynced, it gets default modes and is renamed to `target` (an existing `target` is swapped out, then
    deleted); on failure it is removed and `target` is untouched."""
    tmp = target.parent / tmp_name
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        give_default_modes(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(tmp)  # the directory entries too, before the rename publishes them
        publish_dir(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise naming(exc, target)


def naming(exc: BaseException, path: Path) -> BaseException:
    """`exc`, or for an OSError that names no file (a write or fsync on a full disk names none) the same error
    naming `path`, the file or folder being written: a message can then say where the space ran out."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
        named = OSError(exc.errno, exc.strerror, str(path))  # the same subclass: OSError picks it by errno
        named.__cause__ = exc
        return named
    return exc


def publish_dir(tmp: Path, target: Path) -> None:
    """Rename a complete, synced directory into place; an existing `target` is swapped out, then deleted."""
    old = None
    if target.exists():
        old = target.parent / f"{tmp.name}-old"
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def hash_file_into(digest, path: Path) -> None:
    """Feed a file's bytes to a running hashlib digest, 1 MiB at a time (files may be larger than memory)."""
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    hash_file_into(digest, path)
    return digest.hexdigest()


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def current_umask() -> int:
    umask = os.umask(0)  # the only way to read it; set back at once
    os.umask(umask)
    return umask


def give_default_modes(root: Path) -> None:
    """Give `root` and everything under it the modes open() and mkdir() would (0666/0777 less the umask).
    safetensors' save_file (and so peft's save_pretrained) writes through a 0600 temporary file, and
    shutil.copy keeps its source's mode: outputs a user shares or serves must not differ by how they were made."""
    umask = current_umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def blocking_file(directory: Path) -> Path | None:
    """The file (or FIFO, device...) that stands where `directory` or one of its parents should be, if any: mkdir
    then fails with 'File exists' or 'Not a directory', which names neither that file nor what to do."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def why_not_written(exc: OSError, directory: Path) -> str:
    """Why a folder could not be made or written, in words: a file standing where it (or a parent) should be,
    named, or else what the system said."""
    blocker = blocking_file(directory)
    return f"{blocker} is a file, not a directory" if blocker else str(exc.strerror or exc)


def default_cache_dir() -> Path:
    """Where gpupoor caches tokenized data and built-in models: $GPUPOOR_CACHE, else ~/.cache/gpupoor."""
    return Path(os.environ.get("GPUPOOR_CACHE") or Path.home() / ".cache" / "gpupoor")
