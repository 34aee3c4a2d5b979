"""The unit tier of test_trust.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.cli import invoke

from support.trust import full_disk_on


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_a_tokenize_output_that_cannot_be_written_is_said_before_tokenizing(make_recipe, tmp_path, monkeypatch,
                                                                           where):
    import gpupoor.data.build

    if where == "under-a-file":
        (tmp_path / "plain").write_text("x")
        target = tmp_path / "plain" / "tokenized"
    else:  # read-only for root too
        target = Path("/proc") / "gpupoor-test" / "tokenized"
    monkeypatch.setattr(gpupoor.data.build, "build_data", None)  # tokenizing anything would fail another way
    result = invoke("tokenize", make_recipe(), "--output", target)
    assert result.exit_code == 2, result.output
    assert f"cannot create --output {target}: " in result.output and "Traceback" not in result.output
    if where == "under-a-file":
        assert f"{tmp_path / 'plain'} is a file, not a directory" in result.output
    assert not target.exists()


def test_a_full_disk_while_tokenize_writes_names_the_output(make_recipe, tmp_path, monkeypatch):
    output = tmp_path / "tokenized"
    full_disk_on(monkeypatch, "train.safetensors")
    result = invoke("tokenize", make_recipe(data={"cache_dir": str(tmp_path / "cache")}), "--output", output)
    assert result.exit_code == 1, result.output
    assert f"error: {output}: No space left on device (errno ENOSPC)" in result.output
    assert "Traceback" not in result.output and not output.exists() and list(tmp_path.glob(".tokenized*")) == []


@pytest.mark.parametrize("code, errno_name, expected", [
    (2, "EACCES", "hint: this user may not use that path"), (2, "EROFS", "hint: the file system is read-only"),
    (1, "EDQUOT", "hint: free space on that file system"), (1, "EIO", "(run again with --debug for the traceback)")])
def test_file_system_errors_name_the_path_and_what_to_do(tmp_path, code, errno_name, expected):
    import errno

    from gpupoor.outcome import file_system_error

    number = getattr(errno, errno_name)
    message, exit_code = file_system_error(OSError(number, os.strerror(number), str(tmp_path / "x")))
    assert exit_code == code
    assert message.startswith(f"{tmp_path / 'x'}: {os.strerror(number)} (errno {errno_name})") and expected in message


def test_a_file_in_the_way_is_named(tmp_path):
    import errno

    from gpupoor.outcome import file_system_error

    (tmp_path / "plain").write_text("x")
    for number, path, where in ((errno.ENOTDIR, tmp_path / "plain" / "out", f"{tmp_path / 'plain' / 'out'}: "),
                                (errno.EEXIST, tmp_path / "plain", "")):
        message, exit_code = file_system_error(OSError(number, os.strerror(number), str(path)))
        assert exit_code == 2 and message.startswith(f"{where}{tmp_path / 'plain'} is a file, not a directory")
