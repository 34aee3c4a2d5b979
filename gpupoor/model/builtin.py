"""Models gpupoor builds itself, named `gpupoor:NAME` in a recipe: a shipped recipe works on a fresh clone with
no download. Built from a seed into the cache on first use, committed atomically with a manifest, and verified
against it every time before it is trusted (a damaged copy is built again)."""

from __future__ import annotations

from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.storage.files import blocking_file, default_cache_dir, why_not_written
from gpupoor.recipe.loading import resolve_local_path

PREFIX = "gpupoor:"
VERSION = "v1"  # bump when a builder's output changes
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
_VERIFIED: set[Path] = set()  # built-in model directories this process has verified (or built)


def _build_demo(target: Path) -> None:
    import contextlib
    import sys

    from gpupoor.model.demo_task import build_demo_model, reverse_split
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()
    train_rows, _ = reverse_split(2400, 100)  # the rows of recipes/data/reverse-train.jsonl
    # Nothing of the build reaches stdout: it may be `gpupoor plan --json` output.
    with contextlib.redirect_stdout(sys.stderr):
        build_demo_model(target, train_rows)


BUILDERS = {"demo": (_build_demo, "the demo's 1.1M-parameter random-weight Llama with a BPE tokenizer")}


def builtin_model(name: str) -> Path:
    """The directory of built-in model `name`, built on first use."""
    from gpupoor.storage.checkpoint import verify, write_checkpoint

    if name not in BUILDERS:
        raise UserError(f"model.name_or_path: no built-in model {PREFIX}{name}",
                        hint="built-in models: " + ", ".join(f"{PREFIX}{n} ({what})" for n, (_, what) in BUILDERS.items()))
    target = default_cache_dir() / "models" / f"{name}-{VERSION}"
    if target in _VERIFIED:  # validate, plan and train each resolve it: hash its files once per process
        return target
    if target.exists() and verify(target, REQUIRED) is None:
        _VERIFIED.add(target)
        return target
    build, _ = BUILDERS[name]
    try:
        # The checkpoint commit protocol: built in a temporary folder, manifest last, renamed into place.
        write_checkpoint(target, build, 0, {"builtin": name}, 0)
    except OSError as exc:
        raise UserError(f"cannot build {PREFIX}{name} into {target}: {why_not_written(exc, target.parent)}",
                        hint=f"{'remove it, or ' if blocking_file(target.parent) else ''}set $GPUPOOR_CACHE to a "
                        "writable folder") from None
    _VERIFIED.add(target)
    return target


def resolve_model_path(value: str, base_dir: Path) -> Path | None:
    """The local directory (or .gguf file) a model.name_or_path names (a built-in model, built on first use, or a
    local path), or None for a hub id."""
    if value.startswith(PREFIX):
        return builtin_model(value[len(PREFIX):])
    return resolve_local_path(value, base_dir, (".gguf",))
