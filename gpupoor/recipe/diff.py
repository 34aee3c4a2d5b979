"""What a resume may change: a recipe change is either safe (how long to train, when to save, what to print,
where to evaluate) or changes the training trajectory (everything else), refused with a field-by-field diff
unless --force. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from gpupoor.recipe.schema import SHAREGPT_ROLES, Recipe, is_resume_safe, section_model



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


# Keys added to the schema after runs were written, with the value that means "as before": left out of the hash
# while they hold it, so a checkpoint written by an older gpupoor still matches its run's recipe.
ADDED_KEYS = {"peft.last_layers": None, "distill": None, "distributed.strategy": "auto",
              "distributed.shard_frozen": True, "distributed.reshard_after_forward": True,
              "distributed.cpu_offload": False, "data.datasets": None, "data.tokenized_path": None,
              "data.conversations_field": "conversations", "peft.init_adapter": None,
              "training.objective": "sft", "preference.beta": 0.1, "preference.loss_type": "sigmoid",
              "preference.label_smoothing": 0.0, "preference.orpo_lambda": 0.1, "preference.reference": "auto",
              "preference.reference_bits": None}
# A dict-valued key added later: its flattened keys, with their defaults.
ADDED_KEYS.update({f"data.sharegpt_roles.{key}": value for key, value in SHAREGPT_ROLES.items()})


def trajectory_hash(recipe: Recipe) -> str:
    """Hash of every field that shapes the training trajectory (recorded in each checkpoint's manifest)."""
    fields = {k: v for k, v in _flatten(recipe.model_dump(mode="json")).items()
              if not is_safe(k) and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
