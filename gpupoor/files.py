"""File-system helpers every verb needs. A leaf: imports nothing of gpupoor's."""

from __future__ import annotations

import os
from pathlib import Path


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


def default_cache_dir() -> Path:
    """Where gpupoor caches tokenized data and built-in models: $GPUPOOR_CACHE, else ~/.cache/gpupoor."""
    return Path(os.environ.get("GPUPOOR_CACHE") or Path.home() / ".cache" / "gpupoor")
