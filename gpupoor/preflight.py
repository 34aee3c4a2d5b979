"""`gpupoor validate`: everything that can be checked without loading weights or torch.

Schema (done by load_recipe), data files exist and parse in the recipe's format, the model resolves to a
config. Hub ids are checked against the local cache and, when the network allows, the hub itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpupoor.data.formats import check_row
from gpupoor.data.loading import read_rows, resolve_source
from gpupoor.errors import UserError
from gpupoor.recipe import LoadedRecipe, resolve_local_path

PREFLIGHT_ROWS = 200  # rows parsed per data file: enough to catch a wrong format, fast on big files
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_model(value: str, base_dir: Path) -> list[str]:
    local = resolve_local_path(value, base_dir)
    if local is not None:
        if not local.is_dir():
            raise UserError(f"model.name_or_path: {local} does not exist",
                            hint="relative paths resolve against the recipe file's directory")
        if not (local / "config.json").is_file():
            raise UserError(f"model.name_or_path: {local} has no config.json; it is not a model saved with "
                            "save_pretrained")
        return []
    if not _REPO_ID.match(value):
        raise UserError(f"model.name_or_path: {value!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return []
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return [f"model.name_or_path: {value} is not in the local hub cache and HF_HUB_OFFLINE=1: not verified"]
    return _check_hub_model(value)


def _check_hub_model(value: str) -> list[str]:
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(value, timeout=5)
    except RepositoryNotFoundError:
        raise UserError(f"model.name_or_path: no model {value!r} on the hub (or it is private: "
                        "log in with `hf auth login`)") from None
    except GatedRepoError:
        return [f"model.name_or_path: {value} is gated: accept its license on the hub and log in"]
    except Exception as exc:  # no network, DNS, timeouts: we cannot tell, so do not fail the recipe
        return [f"model.name_or_path: could not reach the hub to check {value} ({type(exc).__name__})"]
    return []


def check_data(value: str, key: str, loaded: LoadedRecipe, split: str) -> list[str]:
    data = loaded.recipe.data
    source = resolve_source(value, loaded.base_dir, split, key)
    if source.kind == "hub":
        return [f"{key}: {value} is a hub dataset name; its rows are checked when training starts"]
    rows = read_rows(source, PREFLIGHT_ROWS)
    if not rows:
        raise UserError(f"{key}: {source.location} has no rows")
    for row in rows:
        check_row(row.fields, row.where, data.format, data.text_field, data.messages_field)
    return []


def preflight(loaded: LoadedRecipe) -> list[str]:
    """Raise UserError on the first definite problem; return warnings for what could not be checked."""
    recipe = loaded.recipe
    warnings = check_model(recipe.model.name_or_path, loaded.base_dir)
    warnings += check_data(recipe.data.path, "data.path", loaded, recipe.data.split)
    if recipe.data.eval_path:
        warnings += check_data(recipe.data.eval_path, "data.eval_path", loaded, "train")
    return warnings
