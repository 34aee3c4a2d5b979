"""Render docs/recipe.md and docs/recipe.schema.json from the schema: `python -m gpupoor.scripts.docs`."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from gpupoor.recipe.loading import recipe_json_schema
from gpupoor.recipe.schema import Recipe, is_resume_safe, section_model

HEADER = """# Recipe reference

A recipe is one YAML file. Generated from the schema in `gpupoor/recipe/schema.py` by `python -m gpupoor.scripts.docs`; do not
edit by hand. Unknown keys are errors (with a "did you mean"). Relative paths resolve against the recipe file.
Any key can be overridden on the command line: `--set training.max_steps=100` (values are parsed as YAML).
Keys marked *May change on resume* can be changed with `gpupoor resume RUN --set KEY=VALUE`; any other change
alters the training trajectory and is refused unless `--force`.

For editor completion, put `# yaml-language-server: $schema=<path>/docs/recipe.schema.json` at the top of a
recipe (or generate the schema with `gpupoor schema > recipe.schema.json`).
"""


def _type_name(annotation) -> str:
    """An annotation as a reader writes it in YAML terms: `list[str] | "all-linear"`, `4 | 8 | null`, `str`.

    Built from typing.get_origin/get_args, never from the repr, so `Optional[...]`, `Union[...]` and
    `typing.` never leak into the reference. `|` is escaped for a markdown table cell."""
    return _render_type(annotation).replace("|", "\\|")


def _render_type(annotation) -> str:
    if annotation is None or annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(value) for value in args)
    if origin is typing.Union or origin is types.UnionType:
        # None last, as `null`, whatever order the annotation names it in
        parts = [_render_type(arg) for arg in args if arg is not type(None)]
        return " | ".join(parts + ["null"] * (type(None) in args))
    if origin is not None:
        name = getattr(origin, "__name__", None) or str(origin).removeprefix("typing.")
        return f"{name}[{', '.join(_render_type(arg) for arg in args)}]" if args else name
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"  # its keys get a table of their own
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).removeprefix("typing.")


def _item_models(annotation) -> list[type[BaseModel]]:
    """Models inside a list-valued key (`list[SourceSection] | None`): each gets a table of its keys."""
    found = []
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
        else:
            found += _item_models(arg)
    return found


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(to_jsonable_python(value))}`"  # (a list of sections: grpo.rewards)


def _row(key: str, field) -> str:
    description = (field.description or "").replace("|", "\\|")
    if is_resume_safe(field):
        description += " *May change on resume.*"
    return f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {description} |"


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    return ["| key | type | default | description |", "|---|---|---|---|"] + \
        [_row(f"{prefix}{name}", field) for name, field in model.model_fields.items()]


def render_recipe_reference() -> str:
    out = [HEADER]
    scalars = []
    for name, field in Recipe.model_fields.items():
        annotation = section_model(field.annotation)
        if annotation is not None:
            safe = " Every key of this section may change on resume." if is_resume_safe(field) else ""
            out += [f"## `{name}`", "", (annotation.__doc__ or "").strip() + safe, ""] + \
                _table(annotation, f"{name}.") + [""]
            for key, inner in annotation.model_fields.items():
                for item in _item_models(inner.annotation):
                    out += [f"### `{name}.{key}[]`", "", (item.__doc__ or "").strip(), ""] + \
                        _table(item, f"{name}.{key}[].") + [""]
        else:
            scalars.append(name)
    out += ["## Top-level keys", "", "| key | type | default | description |", "|---|---|---|---|"]
    out += [_row(name, Recipe.model_fields[name]) for name in scalars]
    return "\n".join(out) + "\n"


def main() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    (docs / "recipe.md").write_text(render_recipe_reference())
    (docs / "recipe.schema.json").write_text(json.dumps(recipe_json_schema(), indent=2) + "\n")
    print(f"wrote {docs / 'recipe.md'} and {docs / 'recipe.schema.json'}")


if __name__ == "__main__":
    main()
