"""`gpupoor plan`: a recipe's memory plan printed (text or JSON) and, with --fit, the recipe changed to fit written
beside it. The arithmetic is gpupoor.plan's; no weights are loaded and torch is not imported."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gpupoor import faults
from gpupoor.errors import EXIT_DOES_NOT_FIT


def plan_recipe(recipe: Path, overrides: list[str], device: str | None, limit: int | None, processes: int, nodes: int,
                as_json: bool, fit: bool, say: Callable[..., None], timing: dict | None = None) -> int:
    """Say the plan (`say(text, err=...)`); with `fit`, write RECIPE.fit.yaml when the recipe does not fit and
    changes can make it. `timing`: the time plan's options (threads, gpu, time_limit), None for none. The exit
    code: 3 when it does not fit (and nothing was written), else 0."""
    from gpupoor.plan.fit import fit_target, write_fit
    from gpupoor.plan.make import make_plan
    from gpupoor.plan.render import render
    from gpupoor.recipe.loading import load_recipe

    loaded = load_recipe(recipe, overrides)
    if fit:
        fit_target(loaded)  # a file of the user's where the fit would go: refused before the plan's work
    if timing is not None:  # JSON's readers get the JSON alone: what was measured is in its time notes
        timing = _timing_options(loaded.recipe, timing, (lambda text: None) if as_json else
                                 (lambda text: say(text, err=True)))
    result = make_plan(loaded, device, memory=limit, processes=processes, nodes=nodes, timing=timing)
    faults.at_stage("working")  # tests: a signal once the plan is made
    say(json.dumps(result.to_json(), indent=2) if as_json else render(result, str(recipe)))
    if fit and result.fits is not False and _over_time(result):
        return _fit_time(loaded, result, device, processes, nodes, timing, as_json, say)
    if fit and result.fits is False:
        if not result.fit_changes:
            return EXIT_DOES_NOT_FIT
        say(write_fit(loaded, result.fit_changes, plan=result), err=as_json)
        return 0
    if fit and not as_json:
        say("fits as it is: nothing to write" if result.fits else "memory unknown: pass --memory")
    return EXIT_DOES_NOT_FIT if result.fits is False else 0


def parse_time_limit(limit: str) -> float:
    """--time-limit in seconds, or a UserError naming it."""
    from gpupoor.errors import UserError
    from gpupoor.units import parse_duration

    try:
        seconds = parse_duration(limit)
    except ValueError as error:
        raise UserError(f"--time-limit {limit!r}: {error}", hint="give a duration, e.g. 12h, 11h30m or 45m") \
            from error
    if not seconds > 0:
        raise UserError(f"--time-limit {limit!r}: must be positive", hint="give a duration, e.g. 12h")
    return seconds


def check_time_options(time_limit: str | None, gpu: str | None) -> None:
    """The time plan's options checked before any work (a recipe loaded, a plan made)."""
    from gpupoor.plan.time.assemble import gpu_on_paper

    if time_limit is not None:
        parse_time_limit(time_limit)
    if gpu is not None:
        gpu_on_paper(gpu)


def check_plan_options(device: str | None, memory: str | None, processes: int, nodes: int, time: bool,
                       time_limit: str | None, gpu: str | None, threads: int | None) -> tuple[int | None, dict | None]:
    """`plan`'s options checked before any work. Returns (the memory to fit in, in bytes or None; the time plan's
    options for plan_recipe, None with --no-time)."""
    from gpupoor.errors import UserError
    from gpupoor.plan.time.assemble import check_environment
    from gpupoor.units import parse_size

    if device is not None and device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: use cpu or cuda")
    limit = parse_size(memory, "--memory") if memory is not None else None
    if limit is not None and limit < 2**20:
        raise UserError(f"--memory {memory!r}: give the memory to fit in, e.g. 16GiB")
    if nodes > processes:
        raise UserError(f"--nodes {nodes} with --processes {processes}: every node runs at least one process")
    check_time_options(time_limit, gpu)
    if time:
        check_environment()
    ignored = [name for name, value in (("--time-limit", time_limit), ("--gpu", gpu), ("--threads", threads))
               if value is not None]
    if not time and ignored:
        raise UserError(f"{', '.join(ignored)} with --no-time: the time plan reads them, and --no-time turns it "
                        "off", hint=f"drop --no-time, or drop {', '.join(ignored)}")
    return limit, None if not time else {"threads": threads, "gpu": gpu, "time_limit": time_limit}


def _timing_options(recipe, options: dict, say) -> dict:
    """gpupoor.plan.time.assemble.time_plan's options: --time-limit (else checkpoint.time_limit) in seconds."""
    limit = options.get("time_limit")
    if limit is not None:
        seconds = parse_time_limit(limit)
    else:
        seconds = recipe.checkpoint.time_limit_s
    return {"threads": options.get("threads"), "gpu": options.get("gpu"), "time_limit_s": seconds, "say": say}


def _over_time(result) -> bool:
    from gpupoor.plan.fit import TIME_FIT_SHARE

    t = result.time
    return t is not None and t.time_limit_s is not None and t.total_s > TIME_FIT_SHARE * t.time_limit_s


def _fit_time(loaded, result, device, processes: int, nodes: int, timing: dict, as_json: bool, say) -> int:
    """plan --fit for a run longer than its time limit: RECIPE.fit.yaml with the changes fit_time finds."""
    from gpupoor.plan.advice import apply_changes
    from gpupoor.plan.fit import fit_time, write_fit
    from gpupoor.plan.make import make_plan
    from gpupoor.recipe.loading import LoadedRecipe

    def replan(changes: dict):
        changed = LoadedRecipe(apply_changes(loaded.recipe, changes), loaded.source, loaded.overridden)
        return make_plan(changed, device, memory=result.memory if result.memory_source == "--memory" else None,
                         processes=processes, nodes=nodes, timing=timing)

    lines, changes = fit_time(loaded, result, replan)
    say("\n".join(["to finish inside the time limit (cheapest first):", *(f"  {line}" for line in lines)]),
        err=as_json)
    if not changes:
        return 0
    say(write_fit(loaded, changes, plan=result), err=as_json)
    return 0
