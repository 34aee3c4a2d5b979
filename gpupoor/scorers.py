"""Scoring a model's answer to a row: the one set of scorers behind `gpupoor eval`'s metrics and the rewards of
on-policy training (GRPO). Torch-free.

A scorer is a name (`exact`, `contains`, `json`, `regex:PATTERN`, `length<=N`) or a user's function named
`module:function`, called as `function(answer, expected, row)` (the model's answer, the row's expected answer or
"" when its format has none, the row's fields) and returning a bool or a number. Whatever a scorer raises or
returns that is not a finite number is a UserError naming the scorer and the row (`file:line`), never a crash in
the middle of a run."""

from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass
from typing import Callable

from gpupoor.errors import UserError

SCORER_HELP = ("exact (the answer equals the expected one, spaces trimmed), contains (holds it), json (parses as "
               "JSON), regex:PATTERN (matches PATTERN anywhere), length<=N (1 up to N characters, falling to 0 at "
               "2N), or module:function (your function(answer, expected, row) returning a bool or a number)")


def _json_ok(answer: str) -> bool:
    try:
        json.loads(answer)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Scorer:
    name: str
    function: Callable[[str, str, dict], float]
    unit_range: bool = True  # its scores lie in [0, 1] (eval's metrics: means read as percentages)

    def __call__(self, answer: str, expected: str, row: dict, where: str) -> float:
        try:
            value = self.function(answer, expected, row)
        except Exception as exc:  # a user's function: said with where, not a traceback mid-run
            raise UserError(f"{self.name} raised {type(exc).__name__}: {exc} on {where}",
                            hint="fix the function (it gets the answer, the expected answer and the row's fields)") \
                from None
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{self.name} returned {value!r} on {where}: a score is a bool or a number") from None
        if not math.isfinite(value) or (self.unit_range and not 0.0 <= value <= 1.0):
            allowed = "a bool or a number in [0, 1]" if self.unit_range else "a finite number"
            raise UserError(f"{self.name} returned {value} on {where}: a score is {allowed}")
        return value


def _builtin(spec: str, option: str) -> Scorer | None:
    """The built-in scorer `spec` names, None for a `module:function`, or a UserError saying what is allowed."""
    builtin = {"exact": lambda a, e, row: a.strip() == e.strip(), "contains": lambda a, e, row: e.strip() in a,
               "json": lambda a, e, row: _json_ok(a)}
    if spec in builtin:
        return Scorer(spec, builtin[spec])
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec[len("regex:"):])
        except re.error as exc:
            raise UserError(f"{option} {spec!r}: not a regular expression ({exc})") from None
        return Scorer(spec, lambda a, e, row: pattern.search(a) is not None)
    length = re.fullmatch(r"length<=(\d+)", spec)
    if length and int(length.group(1)) > 0:
        most = int(length.group(1))
        return Scorer(spec, lambda a, e, row: min(1.0, max(0.0, 2.0 - len(a) / most)))
    module, _, name = spec.partition(":")
    if not (module and name) or spec.startswith("length"):
        raise UserError(f"{option} {spec!r} is not a scorer gpupoor knows", hint=f"use {SCORER_HELP}")
    return None


def check_scorer_name(spec: str, option: str) -> None:
    """A UserError unless `spec` names a scorer: a built-in one, or `module:function` (not imported here: the
    recipe is checked before anything of the user's runs)."""
    _builtin(spec, option)


def parse_scorer(spec: str, option: str = "--metric", unit_range: bool = True) -> Scorer:
    """One scorer named on the command line or in a recipe (`option` says where), or a UserError saying what is
    allowed."""
    scorer = _builtin(spec, option)
    if scorer is not None:
        return scorer
    module, _, name = spec.partition(":")
    function = _import_function(module, name, spec, option)
    return Scorer(spec, function, unit_range)


def _import_function(module: str, name: str, spec: str, option: str) -> Callable:
    """`module`'s `name`, importable from the current directory as docs/cli.md promises (the installed `gpupoor`
    console script's sys.path starts at the venv's bin/, not where the user stands), then PYTHONPATH. Whatever the
    import raises (a missing module, a syntax error, the module's own code failing) is the user's to fix: a
    UserError naming the scorer and what Python said."""
    import os
    import sys

    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.append(here)  # after the installed packages: a local file named like a library does not shadow it
    try:
        function = getattr(importlib.import_module(module), name)
    except AttributeError:
        raise UserError(f"{option} {spec!r}: module {module} has no {name}",
                        hint=f"define {name}(answer, expected, row) in {module}, or name a function it has") from None
    except Exception as exc:  # ImportError, SyntaxError, or whatever the module's code raised
        raise UserError(f"{option} {spec!r}: cannot import {module} ({type(exc).__name__}: {exc})",
                        hint=f"put {module}.py in the current directory ({here}) or a folder on PYTHONPATH, and "
                        "check that `python -c 'import " + module + "'` works there") from None
    finally:
        if added:
            sys.path.remove(here)
    if not callable(function):
        raise UserError(f"{option} {spec!r}: {module}.{name} is {type(function).__name__} data, not a function",
                        hint="name a function(answer, expected, row) returning a number")
    return function


def combined_scores(scorers: list[tuple[Scorer, float]], answers: list[str], expected: list[str], rows: list[dict],
                    wheres: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    """Each answer's weighted sum of scores (GRPO's reward), and every scorer's own scores (its metrics: the
    mean and spread of each reward)."""
    each = {scorer.name: [scorer(a, e, r, w) for a, e, r, w in zip(answers, expected, rows, wheres)]
            for scorer, _ in scorers}
    totals = [sum(weight * each[scorer.name][i] for scorer, weight in scorers) for i in range(len(answers))]
    return totals, each
