"""Render docs/recipe.md and docs/recipe.schema.json from the schema: `python -m gpupoor.docs`."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from gpupoor.recipe import Recipe

HEADER = """# Recipe reference

A recipe is one YAML file. Generated from the schema in `gpupoor/recipe.py` by `python -m gpupoor.docs`; do not
edit by hand. Unknown keys are errors (with a "did you mean"). Relative paths resolve against the recipe file.
Any key can be overridden on the command line: `--set training.max_steps=100` (values are parsed as YAML).

For editor completion, put `# yaml-language-server: $schema=<path>/docs/recipe.schema.json` at the top of a
recipe (or generate the schema with `gpupoor schema > recipe.schema.json`).
"""


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    for noise in ("typing.", "Literal", "NoneType"):
        text = text.replace(noise, "" if noise != "NoneType" else "null")
    return text.replace("[", "").replace("]", "").replace(", ", " \\| ").replace(" | ", " \\| ")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{prefix}{name}` | {_type_name(field.annotation)} | {_default(field)} | {description} |")
    return lines


def render_recipe_reference() -> str:
    out = [HEADER]
    scalars = []
    for name, field in Recipe.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += [f"## `{name}`", "", (annotation.__doc__ or "").strip(), ""] + _table(annotation, f"{name}.") + [""]
        else:
            scalars.append(name)
    out += ["## Top-level keys", "", "| key | type | default | description |", "|---|---|---|---|"]
    for name in scalars:
        field = Recipe.model_fields[name]
        out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {field.description} |")
    return "\n".join(out) + "\n"


def main() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs"
    (docs / "recipe.md").write_text(render_recipe_reference())
    (docs / "recipe.schema.json").write_text(json.dumps(Recipe.model_json_schema(), indent=2) + "\n")
    print(f"wrote {docs / 'recipe.md'} and {docs / 'recipe.schema.json'}")


if __name__ == "__main__":
    main()
