"""The run directory: where it is, whether it may be used, its lock, its session file and its stored recipe.

Every verb that reads or writes a run dir (train, resume, status, plan --fit, merge-lora, generate) comes here;
this module imports only leaves (errors, files, recipe), never a verb.

    RUN_DIR/
      recipe.yaml          the resolved recipe, stored once everything is built (portable: absolute local paths)
      metrics.jsonl        one JSON record per step, eval, checkpoint (gpupoor.train.metrics)
      checkpoints/step-N/  adapter + optimizer + train_state.json + manifest.json (gpupoor.storage.checkpoint)
      final/               the adapter at the end, with its manifest
      session.json         pid, start and time limit of the process training now (gone when it stops)
      .lock                flock held by that process
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import time
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.storage.files import why_not_written, write_text_atomic
from gpupoor.recipe.loading import DATA_SUFFIXES, LoadedRecipe, load_recipe, recipe_to_yaml, resolve_local_path
from gpupoor.recipe.schema import Recipe

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
SESSION = "session.json"  # pid, start time and time limit of the process training in this run dir
LIBRARIES = ("gpupoor", "torch", "transformers", "peft", "accelerate", "bitsandbytes")


def is_run_dir(path: Path) -> bool:
    return (path / RECIPE).is_file()


def require_run_dir(path: Path) -> None:
    if not is_run_dir(path):
        raise UserError(f"{path} is not a gpupoor run directory (no {RECIPE})",
                        hint="pass the directory `gpupoor train` wrote, e.g. runs/my-recipe")


def resolve_run_dir(loaded: LoadedRecipe, output_dir: str | None, stem: str) -> Path:
    if output_dir:  # from the command line: relative to where the user is
        return Path(output_dir).expanduser().resolve()
    if loaded.recipe.output_dir:
        path = Path(loaded.recipe.output_dir).expanduser()
        return path if path.is_absolute() else (loaded.base_dir / path).resolve()
    return (Path.cwd() / "runs" / stem).resolve()


def start_leftover(path: Path) -> bool:
    """What a start that ended before it stored the recipe leaves in its run directory (killed while the model
    loaded, a full disk): the lock file, and an unfinished write of the recipe. No run is there yet."""
    return path.name == RunLock.NAME or (path.name.startswith(f".{RECIPE}.") and path.name.endswith(".tmp"))


def holds_something(run_dir: Path) -> bool:
    """The directory holds more than a failed start's leftovers: an earlier run, or files that are not ours."""
    return any(not start_leftover(path) for path in run_dir.iterdir())


def check_run_dir(run_dir: Path) -> None:
    """A new run needs a new or empty directory (a failed start's leftovers do not count: it starts afresh)."""
    if run_dir.exists() and not run_dir.is_dir():
        kind = "a file" if run_dir.is_file() else "not a directory"
        raise UserError(f"run directory {run_dir} is {kind}",
                        hint="pass --output-dir NEW_DIR (or set output_dir) naming a new or empty directory")
    if run_dir.exists() and holds_something(run_dir):
        new = "pass --output-dir NEW_DIR (or set output_dir) for a new run"
        if not is_run_dir(run_dir):
            hint = f"{new}, or delete the old files"
        elif (run_dir / "final").is_dir():  # finished: a plain resume has nothing left to do
            hint = (f"it is a finished run (final/ is there): {new}; to train it further: gpupoor resume {run_dir} "
                    "--set training.max_steps=N")
        else:
            hint = f"to continue it: gpupoor resume {run_dir}; or {new}"
        raise UserError(f"run directory {run_dir} is not empty; gpupoor never trains over an earlier run",
                        hint=hint)
    if run_dir.is_dir() and RunLock.held(run_dir):  # a start that is still loading its model there
        raise UserError(f"another gpupoor process is starting a run in {run_dir}",
                        hint="wait for it, or pass --output-dir NEW_DIR (or set output_dir) naming another directory")


def check_writable(run_dir: Path, what: str | None = None,
                   hint: str = "pass --output-dir (or set output_dir) to a writable location") -> None:
    """Create the run directory (and a file in it) and remove them again, before anything slow: a read-only or
    impossible location is bad input, said at once, not an OSError after the model has loaded. A full disk is
    the environment's failure, not the input's: its OSError goes on (exit 1, naming the path)."""
    missing = []
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"cannot create {what or f'the run directory {run_dir}'}: {why_not_written(exc, run_dir)}",
                        hint=hint) from None
    finally:
        for path in missing:  # deepest first; leave nothing behind
            with contextlib.suppress(OSError):
                path.rmdir()


def check_work_dir(work_dir: Path, option: str = "--work-dir") -> None:
    """A scratch folder the user named (serve's and export's --work-dir, where a merge of many GB goes): it must be
    a folder this user can write in, and exist already: created for a mistyped path, the merge would fill
    whichever disk that path lands on."""
    if not work_dir.exists():
        raise UserError(f"{option} {work_dir}: does not exist", hint="create it, or choose an existing folder")
    if not work_dir.is_dir():
        raise UserError(f"{option} {work_dir}: is {'a file' if work_dir.is_file() else 'something'}, not a directory",
                        hint="choose a folder")
    if not os.access(work_dir, os.W_OK | os.X_OK):
        raise UserError(f"{option} {work_dir}: this user may not write in it",
                        hint="choose a folder you can write in, or fix its permissions")


class RunLock:
    """An exclusive lock on a run directory for as long as a process trains in it (flock: released by the
    kernel when the process dies, so a crash never leaves a stale lock)."""

    NAME = ".lock"

    def __init__(self, run_dir: Path):
        self.path = run_dir / self.NAME
        self.handle = None

    def acquire(self) -> "RunLock":
        import fcntl

        try:
            self.handle = open(self.path, "a+")
        except OSError as exc:
            raise UserError(f"cannot write in the run directory {self.path.parent}: {exc.strerror or exc}",
                            hint="a run directory must be writable to train in it; copy it to a writable place "
                            "and resume the copy") from None
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            self.handle = None
            raise UserError(f"another gpupoor process is training in {self.path.parent}",
                            hint=f"wait for it to stop (gpupoor status {self.path.parent} shows it)") from None
        return self

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    @staticmethod
    def held(run_dir: Path) -> bool:
        import fcntl

        path = run_dir / RunLock.NAME
        if not path.is_file():
            return False
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
        return False


def write_session(run_dir: Path, time_limit_s: float | None, started_monotonic: float) -> None:
    write_text_atomic(run_dir / SESSION, json.dumps({
        "pid": os.getpid(), "time_limit_s": time_limit_s,
        "started": time.time() - (time.monotonic() - started_monotonic)}))


def read_session(run_dir: Path) -> dict | None:
    """The session of the process training in `run_dir`, or None when unreadable (it may be starting up)."""
    try:
        session = json.loads((run_dir / SESSION).read_text())
        return {"pid": int(session["pid"]), "started": float(session["started"]),
                "time_limit_s": float(session["time_limit_s"]) if session.get("time_limit_s") else None}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def end_session(run_dir: Path) -> None:
    (run_dir / SESSION).unlink(missing_ok=True)


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def store_recipe(run_dir: Path, recipe: Recipe) -> None:
    header = "# resolved recipe written by gpupoor\n" + "".join(f"# {k} {v}\n" for k, v in library_versions().items())
    write_text_atomic(run_dir / RECIPE, recipe_to_yaml(recipe, header))


def stored_recipe(run_dir: Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe a run dir stores (validated like any recipe), with `--set` overrides applied."""
    return load_recipe(run_dir / RECIPE, overrides).recipe


def _absolute_paths(section, keys: tuple[str, ...], base_dir: Path) -> dict:
    """The section's local data paths made absolute (hub names stay as they are)."""
    updates = {}
    for key in keys:
        value = getattr(section, key)
        local = resolve_local_path(value, base_dir, DATA_SUFFIXES) if value else None
        if local is not None:
            updates[key] = str(local)
    return updates


def portable_recipe(loaded: LoadedRecipe) -> Recipe:
    """The recipe as stored in the run dir: local paths made absolute (they no longer resolve against the
    recipe's folder) and no output_dir (the run dir is wherever it is now: copy or move it freely)."""
    recipe = loaded.recipe
    model = recipe.model
    local_model = resolve_local_path(model.name_or_path, loaded.base_dir)
    if local_model is not None:
        model = model.model_copy(update={"name_or_path": str(local_model)})
    data_updates = _absolute_paths(recipe.data, ("path", "eval_path"), loaded.base_dir)
    if recipe.data.tokenized_path:  # always a local directory
        data_updates["tokenized_path"] = str((loaded.base_dir / Path(recipe.data.tokenized_path).expanduser()).resolve())
    if recipe.data.datasets:
        data_updates["datasets"] = [source.model_copy(update=_absolute_paths(source, ("path", "eval_path"),
                                                                             loaded.base_dir))
                                    for source in recipe.data.datasets]
    if recipe.data.cache_dir:  # always a local directory, maybe not created yet
        data_updates["cache_dir"] = str((loaded.base_dir / Path(recipe.data.cache_dir).expanduser()).resolve())
    distill = recipe.distill
    if distill is not None:
        local_teacher = resolve_local_path(distill.teacher, loaded.base_dir)
        if local_teacher is not None:
            distill = distill.model_copy(update={"teacher": str(local_teacher)})
    peft = recipe.peft
    if peft.init_adapter:  # always a local directory: the stored recipe records which adapter the run started from
        peft = peft.model_copy(update={
            "init_adapter": str((loaded.base_dir / Path(peft.init_adapter).expanduser()).resolve())})
    return recipe.model_copy(update={"model": model, "data": recipe.data.model_copy(update=data_updates),
                                     "output_dir": None, "distill": distill, "peft": peft})
