"""`gpupoor plan`: a recipe's memory plan printed (text or JSON) and, with --fit, the recipe changed to fit written
beside it. The arithmetic is gpupoor.plan's; no weights are loaded and torch is not imported."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gpupoor.errors import EXIT_DOES_NOT_FIT


def plan_recipe(recipe: Path, overrides: list[str], device: str | None, limit: int | None, processes: int, nodes: int,
                as_json: bool, fit: bool, say: Callable[..., None]) -> int:
    """Say the plan (`say(text, err=...)`); with `fit`, write RECIPE.fit.yaml when the recipe does not fit and
    changes can make it. The exit code: 3 when it does not fit (and nothing was written), else 0."""
    from gpupoor.plan.fit import write_fit
    from gpupoor.plan.make import make_plan
    from gpupoor.plan.render import render
    from gpupoor.recipe.loading import load_recipe

    loaded = load_recipe(recipe, overrides)
    result = make_plan(loaded, device, memory=limit, processes=processes, nodes=nodes)
    say(json.dumps(result.to_json(), indent=2) if as_json else render(result, str(recipe)))
    if fit and result.fits is False:
        if not result.fit_changes:
            return EXIT_DOES_NOT_FIT
        written = write_fit(loaded, result.fit_changes, plan=result)
        say(f"wrote {written}", err=as_json)
        return 0
    if fit and not as_json:
        say("fits as it is: nothing to write" if result.fits else "memory unknown: pass --memory")
    return EXIT_DOES_NOT_FIT if result.fits is False else 0
