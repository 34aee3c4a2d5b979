"""Orchestration of `gpupoor train` and `gpupoor resume`: the one place that knows every part.

Recipe -> builders -> (checkpoint state loaded into what the builders made) -> loop, with hooks for metrics,
progress, checkpoints, signals and time limits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.recipe import DATA_SUFFIXES, LoadedRecipe, Recipe, load_recipe, recipe_to_yaml, resolve_local_path

SMOKE_ROWS = 16
SMOKE_STEPS = 3
SMOKE_MAX_LENGTH = 256
ASSUMED_WRITE_BYTES_PER_S = 100 * 2**20  # save-time guess until the first checkpoint is measured
MIN_SAVE_RESERVE_S = 1.0  # a save also writes the tokenizer and fsyncs: never assume less than this
SESSION = "session.json"  # pid, start time and time limit of the process training in this run dir


@dataclass
class RunResult:
    run_dir: Path
    reason: str  # "done" | "already_done" | "time_limit" | a signal name
    final_loss: float | None
    steps: int


class RunFailed(Exception):
    """Training cannot go on (diverged, disk full); the last committed checkpoint is intact."""


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("gpupoor", "torch", "transformers", "peft", "accelerate", "bitsandbytes"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def quiet_libraries() -> None:
    """Silence library noise that says nothing to a user of gpupoor."""
    import logging
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress is the one to read
    # peft still asks for the pre-5.x name of the checkpointing flag.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # bitsandbytes tries to fetch an optional CPU kernel from the hub and warns when it can't; it falls back.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def check_launch(environ=os.environ) -> None:
    """`accelerate launch --num_processes N` without --multi_gpu (e.g. with --cpu) runs accelerate's simple
    launcher: ONE process, which only exports MASTER_ADDR/PORT for an mpirun that is not there. Training would
    silently run on one process; say how to launch N instead."""
    launched_by_accelerate = "ACCELERATE_USE_CPU" in environ or "ACCELERATE_MIXED_PRECISION" in environ
    ranked = any(key in environ for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK"))
    if launched_by_accelerate and "MASTER_ADDR" in environ and not ranked:
        raise UserError("accelerate launch started a single process although more were asked for: without "
                        "--multi_gpu (or with --cpu) it uses its one-process launcher, which expects mpirun",
                        hint="on CPUs: torchrun --nproc-per-node N -m gpupoor train RECIPE; on GPUs: accelerate "
                        "launch --multi_gpu --num_processes N -m gpupoor train RECIPE")


def make_accelerator(device: str, precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state; a second run in the same process (the demo, tests, a
    # notebook) with another precision must start from a clean one. Launch settings (DDP etc.) survive.
    AcceleratorState._reset_state()
    return Accelerator(cpu=device == "cpu", mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision])


def smoke_recipe(recipe: Recipe) -> Recipe:
    """The same recipe shrunk for `--smoke`: a few rows, a few steps, CPU, fp32, no checkpoints."""
    data = recipe.data.model_copy(update={
        "max_rows": min(recipe.data.max_rows or SMOKE_ROWS, SMOKE_ROWS),
        "max_length": min(recipe.data.max_length, SMOKE_MAX_LENGTH),
        "eval_rows": min(recipe.data.eval_rows, 4)})
    training = recipe.training.model_copy(update={
        "max_steps": SMOKE_STEPS, "epochs": None, "device": "cpu",
        "micro_batch_size": min(recipe.training.micro_batch_size, 2),
        "gradient_accumulation_steps": min(recipe.training.gradient_accumulation_steps, 2),
        "eval_every_steps": None})
    checkpoint = recipe.checkpoint.model_copy(update={"every_steps": None, "every_minutes": None, "time_limit": None})
    model = recipe.model.model_copy(update={"attention": "auto"})  # flash-attn does not run on the CPU
    return recipe.model_copy(update={"model": model, "data": data, "training": training, "precision": "fp32",
                                     "checkpoint": checkpoint})


def portable_recipe(loaded: LoadedRecipe) -> Recipe:
    """The recipe as stored in the run dir: local paths made absolute (they no longer resolve against the
    recipe's folder) and no output_dir (the run dir is wherever it is now: copy or move it freely)."""
    recipe = loaded.recipe
    model = recipe.model
    local_model = resolve_local_path(model.name_or_path, loaded.base_dir)
    if local_model is not None:
        model = model.model_copy(update={"name_or_path": str(local_model)})
    data_updates = {}
    for key in ("path", "eval_path"):
        value = getattr(recipe.data, key)
        local = resolve_local_path(value, loaded.base_dir, DATA_SUFFIXES) if value else None
        if local is not None:
            data_updates[key] = str(local)
    if recipe.data.cache_dir:  # always a local directory, maybe not created yet
        data_updates["cache_dir"] = str((loaded.base_dir / Path(recipe.data.cache_dir).expanduser()).resolve())
    return recipe.model_copy(update={"model": model, "data": recipe.data.model_copy(update=data_updates),
                                     "output_dir": None})


def resolve_run_dir(loaded: LoadedRecipe, output_dir: str | None, stem: str) -> Path:
    if output_dir:  # from the command line: relative to where the user is
        return Path(output_dir).expanduser().resolve()
    if loaded.recipe.output_dir:
        path = Path(loaded.recipe.output_dir).expanduser()
        return path if path.is_absolute() else (loaded.base_dir / path).resolve()
    return (Path.cwd() / "runs" / stem).resolve()


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        kind = "a file" if run_dir.is_file() else "not a directory"
        raise UserError(f"run directory {run_dir} is {kind}",
                        hint="pass --output-dir NEW_DIR (or set output_dir) naming a new or empty directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        hint = (f"to continue it: gpupoor resume {run_dir}" if (run_dir / "recipe.yaml").is_file()
                else "pass --output-dir NEW_DIR (or set output_dir), or delete the old run")
        raise UserError(f"run directory {run_dir} is not empty; gpupoor never trains over an earlier run",
                        hint=hint)


def check_writable(run_dir: Path) -> None:
    """Create the run directory (and a file in it) and remove them again, before anything slow: a read-only or
    impossible location is bad input, said at once, not an OSError after the model has loaded."""
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
        raise UserError(f"cannot create the run directory {run_dir}: {exc.strerror or exc}",
                        hint="pass --output-dir (or set output_dir) to a writable location") from None
    finally:
        for path in missing:  # deepest first; leave nothing behind
            with contextlib.suppress(OSError):
                path.rmdir()


def total_steps(recipe: Recipe, batches_per_epoch: int, processes: int = 1) -> int:
    if recipe.training.max_steps is not None:
        return recipe.training.max_steps
    epochs = recipe.training.epochs if recipe.training.epochs is not None else 1.0
    per_step = recipe.training.gradient_accumulation_steps * processes  # micro-batches one optimizer step uses
    return max(1, math.ceil(epochs * batches_per_epoch / per_step))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def store_recipe(run_dir: Path, recipe: Recipe) -> None:
    header = "# resolved recipe written by gpupoor\n" + "".join(f"# {k} {v}\n" for k, v in library_versions().items())
    write_text_atomic(run_dir / "recipe.yaml", recipe_to_yaml(recipe, header))


@contextlib.contextmanager
def _stop_requests(stop):
    """The command's StopRequest, or one installed for the length of this call (the demo, a notebook). It is
    installed before anything slow, so a SIGTERM while the model loads stops at step 0 with a checkpoint."""
    if stop is not None:
        yield stop
        return
    from gpupoor.signals import StopRequest

    stop = StopRequest().install()
    try:
        yield stop
    finally:
        stop.uninstall()


def train_from_recipe(loaded: LoadedRecipe, output_dir: str | None = None, smoke: bool = False,
                      say=print, started: float | None = None, plan=None, stop=None) -> RunResult:
    """`started`: time.monotonic() when the command began; the time limit counts from there. `plan`: the
    memory plan the preflight made (made here when not given). `stop`: the command's installed StopRequest."""
    started = time.monotonic() if started is None else started
    recipe = portable_recipe(loaded)
    if smoke:
        recipe = smoke_recipe(recipe)
    stem = (loaded.source.stem if loaded.source else "run") + ("-smoke" if smoke else "")
    temporary = smoke and not output_dir
    run_dir = Path(tempfile.mkdtemp(prefix="gpupoor-smoke-")) if temporary else resolve_run_dir(loaded, output_dir, stem)
    check_run_dir(run_dir)
    check_launch()
    if not temporary:
        check_writable(run_dir)
    try:
        if plan is None and not smoke:
            plan = _plan_quietly(loaded)
        with _stop_requests(stop) as stop:
            return _execute(recipe, run_dir, None, smoke, say, started, plan=plan, stop=stop)
    finally:
        if temporary:
            shutil.rmtree(run_dir, ignore_errors=True)


def resume_run(run_dir: Path, overrides: list[str], force: bool = False, say=print,
               started: float | None = None, stop=None) -> RunResult:
    started = time.monotonic() if started is None else started
    run_dir = run_dir.expanduser().resolve()
    if not (run_dir / "recipe.yaml").is_file():
        raise UserError(f"{run_dir} is not a gpupoor run directory (no recipe.yaml)",
                        hint="pass the directory `gpupoor train` wrote, e.g. runs/my-recipe")
    check_launch()
    lock = RunLock(run_dir).acquire()
    try:
        with _stop_requests(stop) as stop:
            return _resume_locked(run_dir, overrides, force, say, started, lock, stop)
    finally:
        lock.release()


def _resume_locked(run_dir: Path, overrides: list[str], force: bool, say, started: float, lock, stop) -> RunResult:
    from gpupoor.checkpoint import final_problem, latest_valid, sweep_temporary
    from gpupoor.resume import diff_recipes, format_changes

    stored = load_recipe(run_dir / "recipe.yaml").recipe
    # Paths given with --set resolve against the current directory and are stored absolute, like train's.
    recipe = portable_recipe(LoadedRecipe(load_recipe(run_dir / "recipe.yaml", overrides).recipe, None))
    trajectory, safe = diff_recipes(stored, recipe)
    if trajectory and not force:
        raise UserError("these changes alter the training trajectory, so the result would no longer be the "
                        f"run that was started:\n{format_changes(trajectory)}",
                        hint="start a new run with gpupoor train, or pass --force to resume with them anyway")
    if trajectory:
        say(f"warning: --force: resuming with trajectory changes:\n{format_changes(trajectory)}")
    if safe:
        say(f"applying recipe changes:\n{format_changes(safe)}")
    for name in sweep_temporary(run_dir / "checkpoints"):
        say(f"removed an incomplete checkpoint write: {name}")
    checkpoint = latest_valid(run_dir / "checkpoints", warn=say)
    problem = final_problem(run_dir)
    finished = problem is None
    if (run_dir / "final").exists() and problem is not None:
        say(f"warning: final/ is not valid ({problem}): it is written again from the last checkpoint")
    if checkpoint is None:
        if finished:
            say(f"the run in {run_dir} finished but has no checkpoint to continue from")
            return RunResult(run_dir, "already_done", None, 0)
        say("warning: no valid checkpoint: starting this run again from step 0")
    elif finished and checkpoint.step >= _planned_steps(recipe, safe, checkpoint):
        say(f"the run already finished at step {checkpoint.step}: the adapter is in {run_dir / 'final'}\n"
            "  (to train further: gpupoor resume RUN_DIR --set training.max_steps=N)")
        return RunResult(run_dir, "already_done", checkpoint.manifest.get("loss"), checkpoint.step)
    plan = _plan_quietly(LoadedRecipe(recipe, None))
    return _execute(recipe, run_dir, checkpoint, False, say, started, force=force, lock=lock, plan=plan, stop=stop)


def _plan_quietly(loaded: LoadedRecipe, device: str | None = None):
    """The memory plan for the startup summary, or None when the model is not one it can describe."""
    from gpupoor.plan import make_plan

    try:
        return make_plan(loaded, device)
    except Exception:  # advisory: never let the plan stop a run
        return None


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


def _planned_steps(recipe: Recipe, safe_changes: list, checkpoint) -> float:
    """The step count the resumed run aims for, when it can be told without loading data."""
    if recipe.training.max_steps is not None:
        return recipe.training.max_steps
    if any(key in ("training.max_steps", "training.epochs") for key, _, _ in safe_changes):
        return math.inf  # a new epoch count: _execute works out the steps (and does nothing if already there)
    return checkpoint.manifest.get("total_steps", math.inf)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after the checkpoint: they will be trained (and logged) again. So is an eval of the
    checkpoint's own step: a process may have died between the checkpoint and that eval, and the resumed run
    evaluates that step again (the same weights, so the same value) rather than lose it."""
    from gpupoor.train.report import read_metrics

    if path.is_file():
        kept = [record for record in read_metrics(path) if record.get("step", 0) < step
                or (record.get("step", 0) == step and "eval_loss" not in record)]
        write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))


def _execute(recipe: Recipe, run_dir: Path, resume, smoke: bool, say, started: float,
             force: bool = False, lock: RunLock | None = None, plan=None, stop=None) -> RunResult:
    import torch
    from safetensors.torch import load_file

    from gpupoor import faults
    from gpupoor.checkpoint import ADAPTER, STATE, CheckpointError, dir_size, load_torch, rotate, write_checkpoint
    from gpupoor.data.build import build_data
    from gpupoor.hardware import (resolve_attention, resolve_device, resolve_precision, resolve_sampler,
                                  usable_cpu_count)
    from gpupoor.loss import find_fused_head, fused_loss_sum, plain_loss_sum
    from gpupoor.model import build_model, load_tokenizer, model_location, summarize
    from gpupoor.optim import build_optimizer, build_scheduler, optimizer_state_bytes, warmup_steps
    from gpupoor.resume import trajectory_hash
    from gpupoor.train.report import NullWriter
    from gpupoor.train.loop import Hooks, LoopSettings, TooManySkippedSteps, train
    from gpupoor.train.report import MetricsWriter, Progress
    from gpupoor.train.state import TrainState, restore_rng

    quiet_libraries()
    device = resolve_device(recipe.training.device)
    precision = resolve_precision(recipe.precision, device.value)
    attention = resolve_attention(recipe.model.attention, device.value)
    # The Accelerator first: under `accelerate launch` it says which GPU this process owns.
    accelerator = make_accelerator(device.value, precision.value)
    main = accelerator.is_main_process
    if not main:
        say = lambda *args, **kwargs: None  # noqa: E731 -- one process reports
    if device.value == "cpu":
        # Oversubscribed cores are far slower than idle ones: use the cores we may run on, no more.
        torch.set_num_threads(recipe.training.cpu_threads or usable_cpu_count())
    torch.manual_seed(recipe.seed)

    base_dir = Path.cwd()  # the portable recipe holds absolute local paths; hub ids need no base
    location = model_location(recipe.model, base_dir)  # a local directory (built-in models built) or a hub id
    tokenizer = load_tokenizer(location, recipe.model)
    sampler = resolve_sampler(recipe.data.sampler, attention.value, recipe.model.trust_remote_code)
    data = build_data(recipe.data, tokenizer, recipe.training.micro_batch_size, recipe.seed, base_dir,
                      sampler=sampler.value)
    if resume is not None and not force:
        if resume.manifest.get("data_fingerprint") not in (None, data.fingerprint):
            raise UserError("the training data (or tokenizer, format or max_length) is not what this run was "
                            f"trained on: its fingerprint changed since checkpoint {resume.path.name}",
                            hint="restore the original data, or pass --force to continue on the new data")
        if resume.manifest.get("recipe_hash") not in (None, trajectory_hash(recipe)):
            raise UserError(f"run_dir/recipe.yaml no longer describes the run that wrote {resume.path.name} "
                            "(its trajectory settings were edited)",
                            hint="restore them, or pass --force to continue with the edited recipe")
    for warning in data.warnings:
        say(f"warning: {warning}")
    stats = data.train.stats
    model = build_model(location, recipe.model, recipe.peft, recipe.quantization, precision.value,
                        attention.value, str(accelerator.device), recipe.memory.gradient_checkpointing,
                        recipe.seed, smoke, recipe.memory.max_gpu_memory)
    summary = summarize(model)
    raw_optimizer = build_optimizer(recipe.training, model, device.value)
    steps = total_steps(recipe, len(data.plan), accelerator.num_processes)
    warmup = warmup_steps(recipe.training, steps)
    model, optimizer = accelerator.prepare(model, raw_optimizer)
    unwrapped = accelerator.unwrap_model(model)

    state = TrainState()
    if resume is not None:  # latest_valid verified every file the manifest must list
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(unwrapped, load_file(resume.path / ADAPTER, device=str(accelerator.device)))
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"checkpoint {resume.path.name} does not fit this model: unexpected "
                            f"{result.unexpected_keys[:3]}")
        optimizer.load_state_dict(load_torch(resume.path / "optimizer.pt"))
        if accelerator.scaler is not None and (resume.path / "scaler.pt").is_file():
            accelerator.scaler.load_state_dict(load_torch(resume.path / "scaler.pt"))
        if force:
            _apply_hyperparameters(recipe, optimizer)
        state = TrainState.from_dict(json.loads((resume.path / STATE).read_text()))
        warmup = resume.manifest.get("warmup_steps", warmup)  # the run's own warmup: it never restarts
    # Built after the optimizer state is restored: it starts at the current step of the schedule for `steps`.
    scheduler = build_scheduler(recipe.training, raw_optimizer, steps, warmup, state.step)

    checkpointing = {False: "off", True: "on (non-reentrant)",
                     "offload": "on, layer inputs offloaded to CPU" if device.value == "cuda"
                     else "on (offload has no effect on a CPU)"}[recipe.memory.gradient_checkpointing]
    fused, loss_reason = find_fused_head(unwrapped) if recipe.memory.fused_cross_entropy else (None, "memory.fused_cross_entropy: false")
    base_loss = functools.partial(fused_loss_sum, fused=fused) if fused is not None else plain_loss_sum

    verb = "smoke test" if smoke else ("resume" if resume is not None else "train")
    say(f"gpupoor {verb}: {recipe.model.name_or_path}" + (" (shrunken random-weight copy)" if smoke else ""))
    say(f"  device {device.value} ({device.reason}); precision {precision.value} ({precision.reason}); "
        f"attention {attention.value} ({attention.reason})")
    say(f"  processes: {accelerator.num_processes}"
        + (f" (DDP, {accelerator.state.backend})" if accelerator.num_processes > 1 else " (no data parallelism)"))
    say(f"  loss: {'fused chunked cross-entropy' if fused is not None else 'plain cross-entropy'} ({loss_reason}); "
        f"gradient checkpointing: {checkpointing}")
    say(f"  parameters {summary.total_params:,}; trainable {summary.trainable_params:,} "
        f"({summary.trainable_percent:.2f}%); weights {summary.weight_bytes / 2**20:.1f} MiB")
    say(f"  data {stats.kept} examples ({stats.rows} rows; {stats.truncated} truncated to "
        f"{recipe.data.max_length} tokens; {stats.dropped_no_target} without targets dropped); "
        f"{stats.target_tokens / max(stats.tokens, 1):.0%} of tokens are targets"
        + ("; tokenized cache hit" if data.cache_hit else "")
        + (f"; eval {len(data.eval)} examples" if data.eval is not None else ""))
    unit = (f"{recipe.training.micro_batch_size} packed rows of up to {data.plan.row_length} tokens"
            if sampler.value == "packed"
            else f"{recipe.training.micro_batch_size} examples")
    say(f"  {steps} optimizer steps of {recipe.training.gradient_accumulation_steps} x {unit}; "
        f"{len(data.plan)} micro-batches per epoch; sampler {sampler.value} ({sampler.reason})")
    if plan is not None and plan.device != device.value:  # planned for another device than torch found
        plan = _plan_quietly(LoadedRecipe(recipe, None), device.value)
    predicted_mb = None
    if plan is not None:
        from gpupoor.plan import format_bytes

        predicted_mb = round(plan.comparable_peak / 2**20, 1)
        fits = "" if plan.fits is None else (" (fits)" if plan.fits else " (predicted NOT to fit)")
        say(f"  memory plan: peak {format_bytes(plan.peak)} on {plan.device}{fits}; "
            f"activations {format_bytes(next(t.bytes for t in plan.terms if t.key == 'activations'))} "
            "(gpupoor plan RECIPE for every term)")
    if resume is not None:
        say(f"  resuming from {resume.path.name}: step {state.step}, epoch {state.epoch}, "
            f"micro-batch {state.batch_in_epoch} of the epoch")
    say(f"  run directory {run_dir}")

    limit_s = recipe.checkpoint.time_limit_s
    owns_lock = lock is None and main
    if owns_lock:  # a new run: create and lock its directory, then make sure no other run got there first
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire()
        if any(p.name != RunLock.NAME for p in run_dir.iterdir()):
            lock.release()
            check_run_dir(run_dir)
    accelerator.wait_for_everyone()
    if main:
        # Only now, with everything built and loaded, is the (possibly changed) recipe committed.
        store_recipe(run_dir, recipe)
        _truncate_metrics(run_dir / "metrics.jsonl", state.step)  # steps after the checkpoint are redone
        write_text_atomic(run_dir / SESSION, json.dumps({
            "pid": os.getpid(), "time_limit_s": limit_s, "started": time.time() - (time.monotonic() - started)}))
    checkpoints_dir = run_dir / "checkpoints"
    manifest_base = {"recipe_hash": trajectory_hash(recipe), "data_fingerprint": data.fingerprint,
                     "total_steps": steps, "warmup_steps": warmup, "precision": precision.value, "device": device.value,
                     "versions": library_versions()}
    trainable_bytes = sum(p.numel() * p.element_size() for p in unwrapped.parameters() if p.requires_grad)
    saving = {"seconds": 0.0, "bytes": 3 * trainable_bytes + 2**20, "last_time": time.monotonic(),
              "last_step": state.step}
    last_loss: list[float | None] = [None]
    first_step = state.step  # the step this process started from

    def save_files(tmp: Path) -> None:
        unwrapped.save_pretrained(tmp, safe_serialization=True)  # adapter_config.json + adapter_model.safetensors
        tokenizer.save_pretrained(tmp)
        faults.at_stage("weights", state.step)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if accelerator.scaler is not None:
            torch.save(accelerator.scaler.state_dict(), tmp / "scaler.pt")
        faults.at_stage("optimizer", state.step)
        from gpupoor.train.state import capture_rng

        state.rng = capture_rng()
        (tmp / STATE).write_text(json.dumps(state.to_dict()))
        faults.at_stage("state", state.step)

    def save_checkpoint() -> str:
        """Commit checkpoints/step-N for the current state; rotate older ones. Returns its name."""
        name = f"step-{state.step:06d}"
        if not all(torch.isfinite(p).all() for p in unwrapped.parameters() if p.requires_grad):
            raise RunFailed(f"refusing to save {name}: the trainable weights are not finite")
        if accelerator.is_main_process:
            try:
                saving["seconds"] = write_checkpoint(checkpoints_dir / name, save_files, state.step,
                                                     {**manifest_base, "loss": last_loss[0]},
                                                     int(saving["bytes"] * 1.1))
            except CheckpointError as exc:
                raise RunFailed(f"{exc}\n  free some space, then continue with: gpupoor resume {run_dir}") from None
            saving["bytes"] = dir_size(checkpoints_dir / name)
            rotate(checkpoints_dir, recipe.checkpoint.keep_last, state.step)
        accelerator.wait_for_everyone()
        saving["last_time"], saving["last_step"] = time.monotonic(), state.step
        metrics.write({"step": state.step, "checkpoint": name, "save_s": round(saving["seconds"], 3)})
        return name

    def on_step(record: dict, current: TrainState) -> None:
        if predicted_mb is not None:
            record["predicted_peak_mb"] = predicted_mb
        if current.step - first_step in (1, 3) and main:
            # after the first step (optimizer state now exists) and the third (the heap has settled)
            if current.step - first_step == 1:
                record["optimizer_state_mb"] = round(optimizer_state_bytes(optimizer) / 2**20, 2)
            what = "process RSS" if device.value == "cpu" else "allocated, without context and allocator slack"
            versus = "" if predicted_mb is None else \
                f" vs {predicted_mb:.0f} MiB planned ({record['peak_mem_mb'] / predicted_mb - 1:+.0%}; {what})"
            state_text = f"optimizer state {record['optimizer_state_mb']:.1f} MiB; " if "optimizer_state_mb" in record else ""
            progress.message(f"  {state_text}peak memory after step {current.step}: "
                             f"{record['peak_mem_mb']:.0f} MiB{versus}", always=True)
        last_loss[0] = record["loss"]
        metrics.write(record)
        progress.step(record)
        every_steps = recipe.checkpoint.every_steps
        minutes = recipe.checkpoint.interval_minutes
        due = (every_steps and current.step % every_steps == 0) or \
              (minutes and time.monotonic() - saving["last_time"] >= 60 * minutes)
        if due and current.step < steps:
            save_checkpoint()
        faults.after_step(current.step)

    def on_eval(record: dict, current: TrainState) -> None:
        metrics.write(record)
        progress.message(f"step {record['step']}: eval_loss {record['eval_loss']:.4f}")

    def should_stop(current: TrainState, last_step_s: float) -> str | None:
        if stop.requested:
            return stop.name
        if limit_s is None:
            return None
        # Keep twice the save time plus one step in reserve, so the checkpoint lands before the deadline.
        save_s = saving["seconds"] or max(MIN_SAVE_RESERVE_S, saving["bytes"] / ASSUMED_WRITE_BYTES_PER_S)
        return "time_limit" if time.monotonic() - started + 2 * save_s + last_step_s >= limit_s else None

    nan_steps = faults.steps_for("nan")

    def loss_fn(model_, batch):
        loss = base_loss(model_, batch)
        return loss * float("nan") if state.step + 1 in nan_steps else loss

    settings = LoopSettings(total_steps=steps, accumulation=recipe.training.gradient_accumulation_steps,
                            max_grad_norm=recipe.training.max_grad_norm,
                            eval_every=recipe.training.eval_every_steps, pad_id=tokenizer.pad_token_id,
                            eval_micro_batch_size=recipe.training.micro_batch_size,
                            # bitsandbytes 4-bit layers repack their weights in eval mode on some CPUs
                            eval_in_train_mode=recipe.quantization.bits is not None and device.value == "cpu",
                            max_consecutive_skips=recipe.training.max_consecutive_skips,
                            loss_fn=loss_fn if nan_steps else base_loss)
    metrics = MetricsWriter(run_dir / "metrics.jsonl") if main else NullWriter()
    progress = Progress(steps, state.step, recipe.logging.progress if main else "none", recipe.logging.every_steps)
    faults.at_stage("startup")
    if resume is not None:
        restore_rng(state.rng)  # last, so nothing above consumes the restored stream
    try:
        try:
            reason = train(model, optimizer, scheduler, accelerator, data, state, settings,
                           Hooks(on_step=on_step, on_eval=on_eval, should_stop=should_stop))
        except TooManySkippedSteps as exc:
            raise RunFailed(f"{exc}. The last good checkpoint is kept; lower training.learning_rate or check the "
                            f"data, then continue with: gpupoor resume {run_dir}") from None
        finally:
            progress.close()
        if saving["last_step"] != state.step or not (checkpoints_dir / f"step-{state.step:06d}").is_dir():
            name = save_checkpoint()  # also at the end, so `resume --set training.max_steps=N` can extend
        else:
            name = f"step-{state.step:06d}"
    finally:
        metrics.close()
        if main:
            (run_dir / SESSION).unlink(missing_ok=True)
        if owns_lock:
            lock.release()
    if reason != "done":
        faults.at_stage("stopped")
        if reason == "time_limit" and state.step == first_step:
            raise UserError(f"checkpoint.time_limit {recipe.checkpoint.time_limit} is too short for one optimizer "
                            f"step: start-up took {time.monotonic() - started:.0f} s and a checkpoint needs "
                            "time in reserve, so every resume would stop here again",
                            hint=f"continue with a longer limit: gpupoor resume {run_dir} --time-limit DURATION "
                            f"(the checkpoint checkpoints/{name} keeps this run)")
        why = f"time limit {recipe.checkpoint.time_limit} nearly reached" if reason == "time_limit" else reason
        say(f"{why}: stopped after step {state.step} with checkpoint checkpoints/{name}\n"
            f"continue with: gpupoor resume {run_dir}")
        return RunResult(run_dir, reason, last_loss[0], state.step)
    if main:
        write_checkpoint(run_dir / "final", _final_files(unwrapped, tokenizer), state.step,
                         {**manifest_base, "loss": last_loss[0]}, 0)
    accelerator.wait_for_everyone()
    loss_text = f"{last_loss[0]:.4f}" if last_loss[0] is not None else "-"
    where = "smoke test passed" if smoke else f"adapter in {run_dir / 'final'}"
    say(f"done: {state.step} steps in {state.elapsed_s:.1f} s; final loss {loss_text}; {where}")
    return RunResult(run_dir, "done", last_loss[0], state.step)


def _apply_hyperparameters(recipe: Recipe, optimizer) -> None:
    """After a forced resume: the recipe's optimizer settings replace those restored from the checkpoint (the
    saved state carries the old peak learning rate, betas, weight decay). The scheduler, built afterwards,
    takes its peak from `initial_lr`."""
    training = recipe.training
    for group in optimizer.param_groups:
        group["initial_lr"] = training.learning_rate
        group["weight_decay"] = training.weight_decay
        if "betas" in group:
            group["betas"] = tuple(training.adam_betas)
        if "eps" in group and training.optimizer.startswith(("adamw", "paged_adamw")):
            group["eps"] = training.adam_eps


def _final_files(model, tokenizer):
    def save(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return save
