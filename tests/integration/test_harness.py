"""The bad-input harness (tests/support/harness.py): every verb, every option, every kind of bad value. Each case
must exit 2 naming the option or the file, print no traceback, write nothing, and leave the user's files as they
were. The world (a trained run, a recipe, data, a LLaMA-Factory folder) is made once for the module; a case that
wrote something fails, and what it wrote is removed so the next case starts from the same world."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from support.cli import invoke
from support.harness import World, build_world, cases, command_line, content_hashes, snapshot

CASES = cases()


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model) -> World:
    return build_world(tmp_path_factory.mktemp("harness-world"), tiny_model)


@pytest.fixture(scope="module")
def hashes_before(world) -> dict[str, str]:
    return content_hashes(world.root)


def _undo(world: World, before: dict[str, tuple], after: dict[str, tuple]) -> None:
    for new in sorted(set(after) - set(before), key=len):
        path = world.root / new
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("verb, option, bad", CASES, ids=[f"{v} {o} {b.label}" for v, o, b in CASES])
def test_bad_input_is_refused_before_any_work(world, hashes_before, verb, option, bad, monkeypatch):
    monkeypatch.chdir(world.root)
    scratch = world.root / "tmp"
    scratch.mkdir(exist_ok=True)
    # The system's temporary folder, here: the variable for processes the verb starts, and tempfile's cached
    # answer for this one (read once per process, before this test ran)
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    value = bad.value(world)
    args = command_line(verb, option, value, world)
    before = snapshot(world.root)
    result = invoke(*args, monkeypatch=monkeypatch)
    after = snapshot(world.root)
    _undo(world, before, after)
    output = result.output
    shown = f"gpupoor {' '.join(args)}\n{output}"
    assert result.exit_code == 2, shown
    assert "Traceback" not in output, shown
    names = {option, f"'{option}'"} | ({value, Path(value).name} if bad.names_value and value else set())
    if bad.names_value and value:  # a path under a file: the file in the way is what is wrong with it
        names |= {str(parent) for parent in Path(value).parents if parent.is_file()}
    if not option.startswith("-"):  # typer names an argument by its metavar
        names.add(option)
    assert any(name and name in output for name in names), f"names none of {sorted(names)}\n{shown}"
    assert {path: s for path, s in after.items() if path in before and before[path] != s} == {}, \
        f"changed the user's files\n{shown}"
    assert sorted(set(after) - set(before)) == [], f"wrote before refusing\n{shown}"
    assert content_hashes(world.root) == hashes_before, f"changed the bytes of the user's files\n{shown}"
