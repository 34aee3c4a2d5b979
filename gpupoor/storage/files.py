"""File-system primitives every verb needs: atomic files and directories, hashing, modes, the cache folder.

A leaf: imports nothing of gpupoor's. Atomic means a reader (or a process started after a power cut) sees the
old content or the whole new one: write beside the target on the same filesystem, fsync, rename, fsync the
folder that holds the name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
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


# A full disk or quota as the libraries that write model files report it: safetensors' SafetensorError carries
# Rust's io::Error text ("No space left on device (os error 28)", no errno); numpy's tofile (the gguf package
# writes tensors with it) says a short write as "65536 requested and 64864 written", an OSError without errno.
_OUT_OF_SPACE_TEXT = re.compile(r"os error (?:28|122)\b|code: (?:28|122)\b|No space left on device|"
                                r"Disk quota exceeded|\d+ requested and \d+ written")


def ran_out_of_space(exc: BaseException) -> bool:
    """Whether `exc` is a write that failed for want of space (ENOSPC, EDQUOT, or the libraries' words for it)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return (isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError") and \
        bool(_OUT_OF_SPACE_TEXT.search(str(exc)))


# Who wrote a temporary name: `PID@HOST`. A pid means something only on the machine (and in the pid namespace) that
# issued it: two jobs on different nodes sharing a scratch folder must not take each other's live files for a dead
# writer's. The host is the kernel's node name, made safe for a file name.
WRITER = r"(?P<pid>\d+)@(?P<host>[A-Za-z0-9._-]+)"
PID_MAX = 2**22  # Linux's largest pid_max: a larger number is no pid of this machine's


def writer_tag() -> str:
    """This process's `PID@HOST`, for temporary names that a later process may sweep (sweep_leftovers)."""
    return f"{os.getpid()}@{_host()}"


def _host() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname() or "localhost")


def process_alive(pid: int) -> bool:
    """Whether a process of this number runs here (True when that cannot be told: nothing is removed then)."""
    if not 0 < pid <= PID_MAX:
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # it exists, as another user's; or no pid at all
        return True
    return True


def sweep_leftovers(folder: Path, pattern: re.Pattern) -> tuple[list[tuple[Path, int]], list[tuple[Path, str]]]:
    """Remove the entries of `folder` whose names `pattern` matches (with the WRITER groups) and whose writer was
    a process of this host that no longer runs: the temporary files and folders of a writer killed (SIGKILL, a
    power cut, the OOM killer) before it could remove them. Returns (removed with their sizes, kept with why):
    kept are those of a running process (another writer at work, or one that took a dead writer's pid), of
    another host (its processes cannot be seen from here), or that could not be removed."""
    removed: list[tuple[Path, int]] = []
    kept: list[tuple[Path, str]] = []
    if not folder.is_dir():
        return removed, kept
    for entry in sorted(folder.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        if match.group("host") != _host():
            kept.append((entry, f"written on host {match.group('host')}, whose processes cannot be seen from here"))
            continue
        if process_alive(int(match.group("pid"))):
            kept.append((entry, "its process is running (another export or merge?)"))
            continue
        try:
            size = dir_size(entry) if entry.is_dir() and not entry.is_symlink() else entry.lstat().st_size
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except FileNotFoundError:  # removed meanwhile (by another sweep)
            continue
        except OSError as exc:
            kept.append((entry, f"could not be removed: {exc.strerror or exc}"))
            continue
        removed.append((entry, size))
    return removed, kept


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
