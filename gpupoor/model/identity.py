"""What a run's models are: the base (`model.name_or_path`, also DPO's reference copy) and the distillation
teacher (`distill.teacher`), recorded in every checkpoint's manifest ("models") so that a resume notices weights
replaced at the same path (docs/resume.md).

A local directory is its config.json and weight files, each by sha256 (a GGUF file is that one file); a hub id is the commit of the cached
snapshot it resolves to (unknown when nothing is cached: never compared); a built-in `gpupoor:NAME` model is the
hashes of its manifest, verified when it was resolved. Hashing gigabytes at every start would be slow, so a
file's hash is reused while its size, mtime, ctime and inode are those it was hashed at (the previous record, or
the cache's model-hashes.json): replacing or rewriting a file changes its ctime, which no tool sets back.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.model import gguf
from gpupoor.model.builtin import PREFIX, resolve_model_path
from gpupoor.storage.files import default_cache_dir, sha256_file, write_text_atomic

CACHE_FILE = "model-hashes.json"
CACHE_ENTRIES = 2000  # the newest hashes kept in the cache file
# What makes a model: its config and its weights (its tokenizer is part of the data fingerprint).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def run_models(recipe) -> dict[str, tuple[str, str | None]]:
    """The models a recipe loads, by recipe key: (name_or_path, revision). DPO's reference copy is the base."""
    models = {"model.name_or_path": (gguf.joined(recipe.model.name_or_path, getattr(recipe.model, "gguf_file", None)),
                                     recipe.model.revision)}
    if recipe.distill is not None:
        models["distill.teacher"] = (recipe.distill.teacher, recipe.distill.revision)
    return models


def model_identities(recipe, recorded: dict | None = None, base_dir: Path | None = None) -> dict[str, dict]:
    """Each model's identity (see the module's doc), by recipe key. `recorded`: the previous checkpoint's, whose
    hashes are reused for files unchanged since."""
    base_dir = base_dir or Path.cwd()
    known = _cached_hashes()
    for identity in (recorded or {}).values():
        known.update({entry["stat"]: entry["sha256"] for entry in identity.get("files", {}).values()
                      if isinstance(entry, dict) and "stat" in entry and "sha256" in entry})
    identities = {key: model_identity(value, revision, base_dir, known)
                  for key, (value, revision) in run_models(recipe).items()}
    _remember(identities)
    return identities


def model_identity(value: str, revision: str | None, base_dir: Path, known: dict[str, str]) -> dict:
    local = resolve_model_path(value, base_dir)
    if local is None:
        return {"hub": value, "commit": hub_commit(value, revision), "config": _facts(_hub_config(value, revision))}
    builtin = {}
    if value.startswith(PREFIX):  # verified against its manifest when resolved
        manifest = json.loads((local / "manifest.json").read_text())
        builtin = {name: entry["sha256"] for name, entry in manifest["files"].items()}
    if gguf.is_gguf(str(local)) and local.is_file():  # one file: its config and weights both
        return {"path": str(local), "files": _model_files(local, builtin, known),
                "config": config_facts(gguf.read_gguf(local).config)}
    return {"path": str(local), "files": _model_files(local, builtin, known), "config": _facts(local / "config.json")}


def _model_files(local: Path, builtin: dict[str, str], known: dict[str, str]) -> dict[str, dict]:
    """The files that make a model, hashed: a GGUF file itself, or a directory's config.json and weight files."""
    if local.is_file():
        return {local.name: _hashed(local, builtin, known)}
    return {path.name: _hashed(path, builtin, known) for path in (sorted(local.iterdir()) if local.is_dir() else [])
            if path.is_file() and (path.name == "config.json" or path.name.endswith(WEIGHT_SUFFIXES))}


def _hashed(path: Path, builtin: dict[str, str], known: dict[str, str]) -> dict:
    """A file's sha256 (a built-in's from its manifest, else one known for this very file, else computed) and the
    stat it was taken at."""
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"
    return {"sha256": builtin.get(path.name) or known.get(key) or sha256_file(path), "stat": key}


# What says which model an adapter fits: its family, depth and width (config key, and the GPT-2 style name).
SHAPE_KEYS = (("model_type", "model_type"), ("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd"))


def config_facts(config: dict) -> dict:
    """A model config's family, decoder layer count and hidden size (None where it does not say)."""
    return {key: config.get(key, config.get(other)) for key, other in SHAPE_KEYS}


def _facts(config: Path | None) -> dict | None:
    """What generate and merge-lora check a base against (gpupoor.model.merge.check_base_fits): the architecture,
    decoder layer count and hidden size the run trained on."""
    try:
        return config_facts(json.loads(config.read_text())) if config is not None else None
    except (OSError, ValueError, AttributeError):
        return None


def _hub_config(value: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(value, "config.json", revision=revision)
    except (ValueError, OSError):
        return None
    return Path(found) if isinstance(found, str) else None


def hub_commit(value: str, revision: str | None) -> str | None:
    """The commit of the cached snapshot `revision` (default main) of hub model `value` resolves to, or None."""
    found = _hub_config(value, revision)
    return found.parent.name if found is not None else None  # .../snapshots/<commit>/config.json


def identity_change(before: dict, now: dict) -> str | None:
    """What differs between two records of one model, in words; None when nothing that both record differs."""
    if "hub" in before or "hub" in now:
        if before.get("hub") != now.get("hub"):
            return f"{_named(before)} -> {_named(now)}"
        commits = before.get("commit"), now.get("commit")
        return None if None in commits or commits[0] == commits[1] else \
            f"hub {now['hub']}: commit {commits[0]} -> {commits[1]}"
    old, new = ({name: entry.get("sha256") for name, entry in record.get("files", {}).items()}
                for record in (before, now))
    changes = [f"{name} changed" for name in sorted(old.keys() & new.keys()) if old[name] != new[name]]
    changes += [f"{name} added" for name in sorted(new.keys() - old.keys())]
    changes += [f"{name} removed" for name in sorted(old.keys() - new.keys())]
    return f"{now.get('path')}: {', '.join(changes)}" if changes else None


def model_changes(recorded: dict | None, identities: dict[str, dict]) -> dict[str, str]:
    """By recipe key, what changed since a checkpoint recorded `recorded` (older checkpoints record nothing: no
    change can be told)."""
    changes = {}
    for key, now in identities.items():
        before = (recorded or {}).get(key)
        change = identity_change(before, now) if isinstance(before, dict) else None
        if change is not None:
            changes[key] = change
    return changes


def _named(record: dict) -> str:
    return f"hub {record['hub']}" if "hub" in record else str(record.get("path"))


def _cached_hashes() -> dict[str, str]:
    try:
        cached = json.loads((default_cache_dir() / CACHE_FILE).read_text())
        return {key: value for key, value in cached.items() if isinstance(value, str)}
    except (OSError, ValueError, AttributeError):
        return {}


def _remember(identities: dict[str, dict]) -> None:
    """Add this run's file hashes to the cache (a cache that cannot be written only costs hashing again)."""
    fresh = {entry["stat"]: entry["sha256"] for identity in identities.values()
             for entry in identity.get("files", {}).values()}
    if not fresh:
        return
    cached = _cached_hashes()
    if all(cached.get(key) == value for key, value in fresh.items()):
        return
    merged = {key: value for key, value in cached.items() if key not in fresh} | fresh  # newest last
    try:
        write_text_atomic(default_cache_dir() / CACHE_FILE,
                          json.dumps(dict(list(merged.items())[-CACHE_ENTRIES:]), indent=0) + "\n")
    except OSError:
        pass


BASE_KEY = "model.name_or_path"


def base_change(recorded: dict | None, base: str | None, revision: str | None = None,
                base_dir: Path | None = None) -> str | None:
    """What changed in the base a run's weights were trained on, since a manifest recorded it (`recorded`: the
    manifest's "models"), in words; None when nothing did, when nothing was recorded (older runs), or when `base`
    (a --base the user gave) names another model than the recorded one: a base chosen on purpose is not a swap
    (merge.check_base_fits still checks that it fits). Files unchanged since they were hashed are not read again.

    export, merge-lora, generate and chat ask before they load the base; status says it too."""
    record = (recorded or {}).get(BASE_KEY)
    if not isinstance(record, dict):
        return None
    if base is not None and not _names_recorded(record, base, base_dir or Path.cwd()):
        return None
    return identity_change(record, current_identity(record, revision))


def current_identity(record: dict, revision: str | None = None) -> dict:
    """The identity now of the model a record describes (same path or hub id), reusing the record's hashes for
    files whose size, mtime, ctime and inode are those they were hashed at."""
    if "hub" in record:
        return {"hub": record["hub"], "commit": hub_commit(record["hub"], revision)}
    known = _cached_hashes()
    known.update({entry["stat"]: entry["sha256"] for entry in record.get("files", {}).values()
                  if isinstance(entry, dict) and "stat" in entry and "sha256" in entry})
    # Only the files: what identity_change compares (a GGUF's metadata is not parsed again).
    now = {"path": record.get("path"), "files": _model_files(Path(str(record.get("path"))), {}, known)}
    _remember({BASE_KEY: now})
    return now


def _names_recorded(record: dict, base: str, base_dir: Path) -> bool:
    """Whether a model name (a path or a hub id) is the recorded model."""
    if "hub" in record:
        return base == record["hub"]
    local = resolve_model_path(base, base_dir)
    return local is not None and str(local.resolve()) == str(Path(str(record.get("path"))).resolve())


def check_base_unchanged(weights_dir: Path, base: str | None, force: bool, warn, what: str) -> None:
    """Refuse (a UserError: exit 2) to build `what` ("the merged model", "answers") on a base that is not the one
    the weights in `weights_dir` were trained on, as its manifest records it; with `force`, warn and go on."""
    from gpupoor.storage.checkpoint import read_manifest

    revision = None
    if base is None and (weights_dir / "adapter_config.json").is_file():
        revision = json.loads((weights_dir / "adapter_config.json").read_text()).get("revision")
    recorded = read_manifest(weights_dir).get("models")
    record = (recorded or {}).get(BASE_KEY)
    if base is None and isinstance(record, dict) and "path" in record and not Path(str(record["path"])).exists():
        raise UserError(f"the base model the run trained on is no longer at {record['path']}",
                        hint="put it back there, or pass --base with the same model where it is now")
    change = base_change(recorded, base, revision)
    if change is None:
        return
    if not force:
        raise UserError(f"the base model changed since the run trained on it ({change}): {what} would combine the "
                        "trained weights with another model's",
                        hint="restore the base the run trained on, or pass --force to go on with the changed one")
    warn(f"--force: the base model changed since the run trained on it ({change}); {what} uses the changed base")
