"""The manifest of a directory `gpupoor tokenize` wrote, read and checked without torch: `validate` refuses what
training would (no manifest, a damaged one) before anything heavy is imported."""

from __future__ import annotations

import json
from pathlib import Path

from gpupoor.errors import UserError

MANIFEST = "manifest.json"
DIR_KIND, DIR_VERSION = "gpupoor-tokenized", 1
REDO_HINT = "write it again with `gpupoor tokenize RECIPE --output DIR`"


def read_manifest(path: Path) -> dict:
    """The checked manifest of the tokenized directory `path` (a UserError naming data.tokenized_path if it has
    none or it is not one `gpupoor tokenize` wrote)."""
    file = path / MANIFEST
    if not file.is_file():
        raise UserError(f"data.tokenized_path: {path} is not a directory `gpupoor tokenize` wrote (no {MANIFEST})",
                        hint="run `gpupoor tokenize RECIPE --output DIR` and point data.tokenized_path at DIR")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        if manifest.get("kind") != DIR_KIND:
            raise ValueError(f"kind {manifest.get('kind')!r}")
        if manifest.get("version") != DIR_VERSION:
            raise ValueError(f"version {manifest.get('version')!r}; this gpupoor reads version {DIR_VERSION}")
        missing = [key for key in ("tokenizer", "files", "train") if not isinstance(manifest.get(key), dict)]
        missing += [key for key in ("max_length", "data_fingerprint") if key not in manifest]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        if not all(isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
                   for entry in manifest["files"].values()):
            raise ValueError("a file entry without size and sha256")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"data.tokenized_path: {file} is not a gpupoor tokenize manifest ({exc})",
                        hint=REDO_HINT) from None
    return manifest
