"""`gpupoor convert-recipe`: a LLaMA-Factory or axolotl YAML written as a gpupoor recipe (gpupoor/recipe/convert.py
does the mapping), never over an existing file unless asked."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError


def convert_recipe(theirs: Path, *, output: Path | None = None, force: bool = False,
                   say: Callable[[str], None] = print) -> Path:
    from gpupoor.recipe.convert import convert_file, render
    from gpupoor.storage.files import write_text_atomic

    target = output or theirs.with_name(f"{theirs.stem}.gpupoor.yaml")
    if target.exists() and not force:
        raise UserError(f"{target} already exists", hint="choose another --output, or --force to replace it")
    converted = convert_file(theirs, target.parent)
    write_text_atomic(target, render(converted, theirs))
    say(f"wrote {target}" + (f" ({len(converted.notes)} keys not carried over: listed at its top)"
                             if converted.notes else ""))
    say(f"check it: gpupoor validate {target}")
    return target
