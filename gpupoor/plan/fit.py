"""`plan --fit`: RECIPE.fit.yaml beside the recipe, extending it with only the keys the plan changed."""

from __future__ import annotations

from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.plan.advice import apply_changes
from gpupoor.plan.result import Plan
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.units import format_bytes


def write_fit(loaded: LoadedRecipe, changes: dict, plan: Plan | None = None) -> Path:
    """Write RECIPE.fit.yaml beside the recipe: `extends: RECIPE` and only the keys the plan changed (and those
    `--set` gave it), so the user's file stays the source of truth; a comment says what was predicted (`plan`)."""
    import yaml

    from gpupoor.storage.files import write_text_atomic
    from gpupoor.recipe.loading import EXTENDS

    if loaded.source is None:
        raise UserError("plan --fit writes a recipe that extends the recipe file: it needs one")
    source = loaded.source
    target = source.with_name(source.stem + ".fit.yaml")
    fitted = apply_changes(loaded.recipe, changes).model_dump(mode="json")
    keys = list(dict.fromkeys([*loaded.overridden, *changes]))
    body = {EXTENDS: source.name}  # beside the recipe: its relative paths resolve as they did
    for key in keys:
        _set_dotted(body, key, _get_dotted(fitted, key))
    try:
        write_text_atomic(target, _fit_header(source.name, changes, loaded.overridden, plan)
                          + yaml.safe_dump(body, sort_keys=False))
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}",
                        hint="copy the recipe to a writable folder and run plan --fit there") from None
    return target


def _fit_header(name: str, changes: dict, overridden: tuple[str, ...], plan: Plan | None) -> str:
    lines = ["Written by gpupoor plan --fit: only the keys the plan changed. " + name + " stays the source of",
             "truth: edit it, then run plan --fit again."]
    if plan is not None and plan.memory is not None:
        per_process = f" per process ({plan.share} share it)" if plan.share > 1 else ""
        lines.append(f"Predicted on {plan.device} ({plan.precision}): {name} peaks at {format_bytes(plan.peak)}, over "
                     f"the {format_bytes(plan.memory // plan.share)}{per_process} of memory ({plan.memory_source})"
                     + (f";\nwith the changes below, {format_bytes(plan.fit_peak)}." if plan.fit_peak else "."))
    lines.append("Changed to fit: " + ", ".join(changes))
    planned_with = [key for key in overridden if key not in changes]
    if planned_with:
        lines.append(f"From --set (the plan was made with them): {', '.join(planned_with)}")
    return "".join(f"# {line}\n" for text in lines for line in text.split("\n"))


def _get_dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def _set_dotted(tree: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
