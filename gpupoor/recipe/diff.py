"""What a resume may change: a recipe change is either safe (how long to train, when to save, what to print,
where to evaluate) or changes the training trajectory (everything else), refused with a field-by-field diff
unless --force. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from gpupoor.recipe.schema import ADDED_MARK, Recipe, is_added, is_resume_safe, section_model


def _safe_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> tuple[str, ...]:
    """Dotted keys marked RESUME_SAFE on the schema; a marked section ends in '.' (all of its keys)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        section = section_model(field.annotation)
        if is_resume_safe(field):
            keys.append(f"{prefix}{name}." if section else f"{prefix}{name}")
        elif section:
            keys += _safe_keys(section, f"{prefix}{name}.")
    return tuple(keys)


SAFE_KEYS = _safe_keys()


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        flat: dict[str, object] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def is_safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in SAFE_KEYS)


def diff_recipes(old: Recipe, new: Recipe) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """(trajectory changes, safe changes), each as (dotted key, old value, new value)."""
    before, after = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    changes = [(key, before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
               if before.get(key) != after.get(key)]
    return [c for c in changes if not is_safe(c[0])], [c for c in changes if is_safe(c[0])]


def format_changes(changes: list[tuple[str, object, object]]) -> str:
    return "\n".join(f"    {key}: {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in changes)


def _added_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, object]:
    """Dotted keys marked ADDED on the schema, each with the value that means "as before" (a dict-valued key:
    each of its flattened keys, with its value)."""
    keys: dict[str, object] = {}
    for name, field in model.model_fields.items():
        section = section_model(field.annotation)
        if is_added(field):
            keys.update(_flatten({name: field.json_schema_extra[ADDED_MARK]}, prefix))
        elif section:
            keys.update(_added_keys(section, f"{prefix}{name}."))
    return keys


# Keys added to the schema after runs were written, with the value that means "as before": left out of the hash
# while they hold it, so a checkpoint written by an older gpupoor still matches its run's recipe.
ADDED_KEYS = _added_keys()


def trajectory_hash(recipe: Recipe) -> str:
    """Hash of every field that shapes the training trajectory (recorded in each checkpoint's manifest)."""
    fields = {k: v for k, v in _flatten(recipe.model_dump(mode="json")).items()
              if not is_safe(k) and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
