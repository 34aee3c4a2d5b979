"""Shared by the trust tests (moved from integration/test_trust.py, whose tests still use them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _train_process(recipe: Path, run: Path, fault: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUPOOR_FAULT": fault}
    return subprocess.run([sys.executable, "-m", "gpupoor", "train", str(recipe), "--output-dir", str(run)],
                          env=env, capture_output=True, text=True)


def full_disk_on(monkeypatch, name_prefix: str) -> None:
    """fsync of a file whose name starts with `name_prefix` fails as on a full disk (naming no file, as it does)."""
    import errno

    import gpupoor.storage.files

    real = gpupoor.storage.files.fsync_file

    def fsync_file(path: Path) -> None:
        if path.name.startswith(name_prefix):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path)

    monkeypatch.setattr(gpupoor.storage.files, "fsync_file", fsync_file)
