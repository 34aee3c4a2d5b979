"""The scratch folder export and serve merge into (gpupoor.model.merge.merge_scratch): named with this process so
that the next run's sweep tells a killed process's folder from a running one's, and gone on the way out."""

from __future__ import annotations

import pytest

import gpupoor.storage.files as files
from gpupoor.model.merge import merge_scratch, scratch_prefix, sweep_merge_scratch
from gpupoor.storage.files import writer_tag


def test_the_scratch_folder_carries_this_process_and_is_removed_after_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="merge failed"):
        with merge_scratch("export", tmp_path) as scratch:
            assert scratch.parent == tmp_path and scratch.is_dir()
            assert scratch.name.startswith(f"{scratch_prefix('export')}{writer_tag()}-")
            (scratch / "merged").mkdir()
            (scratch / "merged" / "model.safetensors").write_bytes(b"0" * 100)
            raise RuntimeError("merge failed")
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_removes_only_a_dead_processs_folder_of_its_own_verb(tmp_path, monkeypatch):
    host = writer_tag().split("@", 1)[1]
    gone = 2**22 - 7  # a pid taken as a process that ended (below)
    dead = tmp_path / f"{scratch_prefix('serve')}{gone}@{host}-abc123xy"
    alive = tmp_path / f"{scratch_prefix('serve')}{writer_tag()}-zzz999qq"
    other_verb = tmp_path / f"{scratch_prefix('export')}{gone}@{host}-abc123xy"
    elsewhere = tmp_path / f"{scratch_prefix('serve')}{gone}@another-host-abc123xy"
    for folder in (dead, alive, other_verb, elsewhere):
        folder.mkdir()
        (folder / "weights").write_bytes(b"0" * 1000)
    real_alive = files.process_alive
    monkeypatch.setattr(files, "process_alive", lambda pid: pid != gone and real_alive(pid))
    removed, kept = sweep_merge_scratch(tmp_path, "serve")
    assert [(entry, size) for entry, size in removed] == [(dead, 1000)]
    assert sorted(entry for entry, _ in kept) == sorted([alive, elsewhere])
    assert other_verb.exists() and alive.exists() and elsewhere.exists() and not dead.exists()
