"""`gpupoor convert-recipe`: a LLaMA-Factory or axolotl YAML written as a gpupoor recipe (gpupoor/recipe/convert.py
does the mapping), never over an existing file unless asked, and never, even with --force, over a file the
conversion reads (their YAML itself, its dataset_info.json, a data file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError


def convert_recipe(theirs: Path, *, output: Path | None = None, force: bool = False,
                   say: Callable[[str], None] = print) -> Path:
    from gpupoor.recipe.convert import convert_file, render
    from gpupoor import faults
    from gpupoor.storage.files import atomic_file

    target = output or theirs.with_name(f"{theirs.stem}.gpupoor.yaml")
    _refuse_if_read(target, [theirs], "the recipe being converted")
    if target.is_dir():
        raise UserError(f"--output {target} is a directory", hint="give --output a file name, such as "
                        f"{target / (theirs.stem + '.gpupoor.yaml')}")
    if target.exists() and not force:
        raise UserError(f"{target} already exists", hint="choose another --output, or --force to replace it")
    converted = convert_file(theirs, target.parent)
    _refuse_if_read(target, converted.read[1:], "a file the recipe reads")
    with atomic_file(target) as tmp:
        tmp.write_text(render(converted, theirs), encoding="utf-8")
        faults.at_stage("working")  # tests: a signal with the recipe half written
    say(f"wrote {target}" + (f" ({len(converted.notes)} keys not carried over: listed at its top)"
                             if converted.notes else ""))
    say(f"check it: gpupoor validate {target}")
    return target


def _refuse_if_read(target: Path, inputs: list[Path], what: str) -> None:
    """Refuse to write `target` over one of `inputs`, however it is named (./lf.yaml, a symlink, a hard link)."""
    for path in inputs:
        if _same_file(target, path):
            raise UserError(f"--output {target} is {what} ({path}): writing it would replace it, even with --force",
                            hint="choose another --output (the default is THEIRS.gpupoor.yaml beside it)")


def _same_file(a: Path, b: Path) -> bool:
    """The same file: the same resolved path, or (a symlink, a hard link) the same inode."""
    if a.expanduser().resolve() == b.expanduser().resolve():
        return True
    try:
        return os.path.samefile(a.expanduser(), b.expanduser())
    except OSError:  # one of them does not exist: not the same file
        return False
