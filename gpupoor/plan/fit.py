"""`plan --fit`: RECIPE.fit.yaml beside the recipe, extending it with only the keys the plan changed."""

from __future__ import annotations

from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.plan.advice import apply_changes
from gpupoor.plan.result import Plan
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.units import format_bytes


# A time fit aims at this share of the limit: the time plan is calibrated to within 20% of measured runs.
TIME_FIT_SHARE = 0.8


def fit_time(loaded: LoadedRecipe, plan: Plan, replan) -> tuple[list[str], dict | None]:
    """Changes that make the run finish inside its time limit in one session, each with its cost: gradient
    checkpointing off where the memory allows it (recomputation costs a third of a step's work), then fewer
    optimizer steps (training.max_steps: the rest of the data is not trained on). `replan(changes)`: the plan with
    `changes` applied (memory and time). Returns (lines saying each change and its cost, the changes to write)."""
    timing = plan.time
    budget = TIME_FIT_SHARE * timing.time_limit_s
    lines, changes, current = [], {}, plan
    recipe = loaded.recipe
    if recipe.memory.gradient_checkpointing:
        candidate = replan({"memory.gradient_checkpointing": False})
        if candidate.fits is not False and candidate.time is not None:
            lines.append(f"memory.gradient_checkpointing: false: {_age(timing.total_s)} -> "
                         f"{_age(candidate.time.total_s)}; cost: peak {format_bytes(plan.peak)} -> "
                         f"{format_bytes(candidate.peak)}" + (" (fits)" if candidate.fits else ""))
            changes, current = {"memory.gradient_checkpointing": False}, candidate
    t = current.time
    if t.total_s > budget:
        fixed = t.startup_s + t.first_step_s + t.save_s  # start-up and final/'s save
        per_step = t.used_step_s + max(t.saves - 1, 0) * t.save_s / max(t.steps, 1)
        steps = int((budget - fixed) / per_step)
        if steps < 1:
            return lines + ["no change fits: start-up and one step take longer than the limit"], None
        lines.append(f"training.max_steps: {steps} (of {t.steps}): about {_age(fixed + steps * per_step)}; cost: "
                     f"{steps * t.tokens_per_step:,.0f} of {t.steps * t.tokens_per_step:,.0f} tokens trained on "
                     f"({steps / t.steps:.0%})")
        changes = {**changes, "training.max_steps": steps}
    return lines, changes


def _age(seconds: float) -> str:
    from gpupoor.units import format_duration

    return format_duration(seconds, style="age")


FIT_HEADER = "# Written by gpupoor plan --fit"


def fit_target(loaded: LoadedRecipe) -> tuple[Path, bool]:
    """Where plan --fit writes (RECIPE.fit.yaml beside the recipe), and whether that replaces an earlier fit. A file
    there that plan --fit did not write (its first line is not FIT_HEADER) is the user's: a UserError, checked before
    the plan is made."""
    if loaded.source is None:
        raise UserError("plan --fit writes a recipe that extends the recipe file: it needs one")
    target = loaded.source.with_name(loaded.source.stem + ".fit.yaml")
    if not target.exists() and not target.is_symlink():
        return target, False
    try:
        ours = target.is_file() and target.read_bytes()[:len(FIT_HEADER)] == FIT_HEADER.encode()
    except OSError:
        ours = False
    if not ours:
        raise UserError(f"{target} exists and plan --fit did not write it: --fit would replace it",
                        hint="move or rename that file, then run plan --fit again")
    return target, True


def write_fit(loaded: LoadedRecipe, changes: dict, plan: Plan | None = None) -> str:
    """Write RECIPE.fit.yaml beside the recipe: `extends: RECIPE` and only the keys the plan changed (and those
    `--set` gave it), so the user's file stays the source of truth; a comment says what was predicted (`plan`).
    Returns the line to say: the file written, and that it replaced an earlier fit when it did."""
    import yaml

    from gpupoor.storage.files import write_text_atomic
    from gpupoor.recipe.loading import EXTENDS

    target, replaced = fit_target(loaded)
    source = loaded.source
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
    return f"wrote {target}" + (" (replacing the one an earlier plan --fit wrote)" if replaced else "")


def _fit_header(name: str, changes: dict, overridden: tuple[str, ...], plan: Plan | None) -> str:
    lines = [FIT_HEADER[2:] + ": only the keys the plan changed. " + name + " stays the source of",
             "truth: edit it, then run plan --fit again."]
    if plan is not None and plan.time is not None and plan.fits is not False:
        lines.append(f"Predicted on {plan.device}: {name} trains in {_age(plan.time.total_s)}, over "
                     f"{TIME_FIT_SHARE:.0%} of the time limit {_age(plan.time.time_limit_s)}.")
    elif plan is not None and plan.memory is not None:
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
