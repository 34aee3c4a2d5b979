"""Orchestration of `gpupoor train` and `gpupoor resume`: the one place that knows every part.

One run is a few stages, each a page or less, in the order they happen:

    build_session   recipe -> hardware choices, tokenizer, data, model, optimizer     (builders: model, data, optim)
    restore         a checkpoint's tensors and progress into what was built          (checkpoint)
    print_summary   what was chosen and why
    open_run_dir    lock it, store the recipe, trim metrics redone after the checkpoint (rundir)
    train           the loop with RunHooks: metrics, progress, CheckpointPolicy, stop requests
    finish          the final adapter, or why it stopped and how to continue

Where new things go: a training method is built in model.py (its rules in decisions.py); a tracker is a writer
beside MetricsWriter, called from RunHooks.on_step/on_eval; a distributed strategy is chosen in
make_accelerator (its rules in decisions.py); a data source or mixture lands in gpupoor/data.
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
from dataclasses import dataclass, field
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.recipe.schema import Recipe
from gpupoor.storage.rundir import (RunLock, check_run_dir, check_writable, end_session, holds_something, portable_recipe,
                            resolve_run_dir, store_recipe, stored_recipe, write_session)

SMOKE_ROWS = 16
SMOKE_STEPS = 3
SMOKE_MAX_LENGTH = 256
FULL_SHARD_SIZE = "2GB"  # shards of a full fine-tune's checkpoints and final/, as the hub's models are cut


@dataclass
class RunResult:
    run_dir: Path
    reason: str  # "done" | "already_done" | "time_limit" | a signal name
    final_loss: float | None
    steps: int


class RunFailed(Exception):
    """Training cannot go on (diverged, disk full); the last committed checkpoint is intact."""


# ----------------------------------------------------------------------------------------------------------
# Entry points


def train_from_recipe(loaded: LoadedRecipe, output_dir: str | None = None, smoke: bool = False,
                      say=print, started: float | None = None, plan=None, stop=None) -> RunResult:
    """A new run. `started`: time.monotonic() when the command began; the time limit counts from there.
    `plan`: the memory plan the preflight made (made here when not given). `stop`: the command's StopRequest."""
    started = time.monotonic() if started is None else started
    recipe = portable_recipe(loaded)
    if smoke:
        recipe = smoke_recipe(recipe)
    stem = (loaded.source.stem if loaded.source else "run") + ("-smoke" if smoke else "")
    temporary = smoke and not output_dir
    run_dir = Path(tempfile.mkdtemp(prefix="gpupoor-smoke-")) if temporary else resolve_run_dir(loaded, output_dir, stem)
    check_run_dir(run_dir)
    check_launch()
    if not temporary and _first_process():
        check_writable(run_dir)  # one process: others would race its probe's mkdir and rmdir
    try:
        if plan is None and not smoke:
            plan = _plan_quietly(loaded)
        with _stop_requests(stop) as stop:
            return _execute(recipe, run_dir, None, smoke, say, started, plan=plan, stop=stop)
    finally:
        if temporary:
            shutil.rmtree(run_dir, ignore_errors=True)


def resume_run(run_dir: Path, overrides: list[str], force: bool = False, say=print,
               started: float | None = None, stop=None, recipe: LoadedRecipe | None = None) -> RunResult:
    """Continue a run from its newest valid checkpoint (or say it is already done). `recipe`: a recipe file to
    resume with instead of the stored one plus `overrides` (train --resume-if-present); its differences from
    the stored recipe are judged like --set changes."""
    from gpupoor.storage.rundir import require_run_dir

    started = time.monotonic() if started is None else started
    run_dir = run_dir.expanduser().resolve()
    require_run_dir(run_dir)
    check_launch()
    if not _first_process():  # one process (the first) holds the lock and speaks for the others
        with _stop_requests(stop) as stop:
            return _resume_locked(run_dir, overrides, force, lambda *args, **kwargs: None, started, None, stop,
                                  recipe)
    lock = RunLock(run_dir).acquire()
    try:
        with _stop_requests(stop) as stop:
            return _resume_locked(run_dir, overrides, force, say, started, lock, stop, recipe)
    finally:
        lock.release()


def _first_process() -> bool:
    """True in the process of rank 0 (or the only one), before accelerate is set up: launchers export RANK."""
    return int(os.environ.get("RANK", "0")) == 0


def _resume_locked(run_dir: Path, overrides: list[str], force: bool, say, started: float, lock, stop,
                   replacement: LoadedRecipe | None = None) -> RunResult:
    from gpupoor.storage.checkpoint import final_problem, latest_valid, sweep_temporary
    from gpupoor.recipe.diff import diff_recipes, format_changes

    stored = stored_recipe(run_dir)
    # Paths given with --set resolve against the current directory and are stored absolute, like train's.
    recipe = portable_recipe(replacement or LoadedRecipe(stored_recipe(run_dir, overrides), None))
    trajectory, safe = diff_recipes(stored, recipe)
    if trajectory and not force:
        raise UserError("these changes alter the training trajectory, so the result would no longer be the "
                        f"run that was started:\n{format_changes(trajectory)}",
                        hint="start a new run with gpupoor train, or pass --force to resume with them anyway")
    if trajectory:
        say(f"warning: --force: resuming with trajectory changes:\n{format_changes(trajectory)}")
    if safe:
        say(f"applying recipe changes:\n{format_changes(safe)}")
    for name in sweep_temporary(run_dir / "checkpoints") if lock is not None else ():
        say(f"removed an incomplete checkpoint write: {name}")
    from gpupoor.train.distributed import optimizer_problem

    checkpoint = latest_valid(run_dir / "checkpoints", warn=say, check=optimizer_problem)
    problem = final_problem(run_dir)
    finished = problem is None
    if (run_dir / "final").exists() and problem is not None:
        say(f"warning: final/ is not valid ({problem}): it is written again from the last checkpoint")
    if checkpoint is None:
        if finished:
            say(f"the run in {run_dir} finished but has no checkpoint to continue from")
            return RunResult(run_dir, "already_done", None, 0)
        say("warning: no valid checkpoint: starting this run again from step 0")
    elif finished and (checkpoint.step >= _planned_steps(recipe, safe, checkpoint) or _stopped_early(run_dir, safe)):
        say(f"the run already finished at step {checkpoint.step}: the adapter is in {run_dir / 'final'}\n"
            "  (to train further: gpupoor resume RUN_DIR --set training.max_steps=N"
            + ("; it stopped early: a larger training.early_stopping_patience trains on)" if _stopped_early(run_dir, safe)
               else ")"))
        return RunResult(run_dir, "already_done", checkpoint.manifest.get("loss"), checkpoint.step)
    plan = _plan_quietly(LoadedRecipe(recipe, None))
    return _execute(recipe, run_dir, checkpoint, False, say, started, force=force, lock=lock, plan=plan, stop=stop)


def _stopped_early(run_dir: Path, safe_changes: list) -> bool:
    """The finished run stopped early (final/'s manifest says so: it was verified) and nothing that decides
    stopping changed since."""
    from gpupoor.storage.checkpoint import read_manifest

    decisive = ("training.early_stopping",)  # more steps change nothing: the same evals would stop it again
    return read_manifest(run_dir / "final").get("stop") == "early_stop" and \
        not any(key.startswith(decisive) for key, _, _ in safe_changes)


def _planned_steps(recipe: Recipe, safe_changes: list, checkpoint) -> float:
    """The step count the resumed run aims for, when it can be told without loading data."""
    if recipe.training.max_steps is not None:
        return recipe.training.max_steps
    if any(key in ("training.max_steps", "training.epochs") for key, _, _ in safe_changes):
        return math.inf  # a new epoch count: the run works out the steps (and does nothing if already there)
    return checkpoint.manifest.get("total_steps", math.inf)


def _plan_quietly(loaded: LoadedRecipe, device: str | None = None):
    """The memory plan for the startup summary (one of the processes launched), or None when the model is not
    one it can describe."""
    from gpupoor.decisions import launch_layout
    from gpupoor.plan.make import make_plan

    try:
        return make_plan(loaded, device, None, *launch_layout(os.environ))
    except Exception:  # advisory: never let the plan stop a run
        return None


@contextlib.contextmanager
def _stop_requests(stop):
    """The command's StopRequest, or one installed for the length of this call (the demo, a notebook). It is
    installed before anything slow, so a SIGTERM while the model loads stops at step 0 with a checkpoint."""
    if stop is not None:
        yield stop
        return
    from gpupoor.run.signals import StopRequest

    stop = StopRequest().install()
    try:
        yield stop
    finally:
        stop.uninstall()


def check_launch(environ=os.environ) -> None:
    """A launch gpupoor cannot train under is refused before anything loads.

    - DeepSpeed from an accelerate config: see the message.
    - accelerate's own FSDP config: accelerate would wrap the model behind gpupoor's back (gpupoor shards with
      FSDP2 itself when the recipe says distributed.strategy: fsdp, and writes its checkpoints to match).
    - `accelerate launch --num_processes N` without --multi_gpu (e.g. with --cpu) runs accelerate's simple
      launcher: ONE process, which only exports MASTER_ADDR/PORT for an mpirun that is not there. Training
      would silently run on one process; say how to launch N instead."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise UserError("this accelerate config launches DeepSpeed, which gpupoor does not train with: DeepSpeed's "
                        "engine steps the optimizer inside backward and keeps its own partitioned optimizer "
                        "state, so gpupoor could neither normalize accumulation by target tokens, skip a "
                        "non-finite step, nor checkpoint and resume the run exactly",
                        hint="use the same sharding through PyTorch: --set distributed.strategy=fsdp (ZeRO-3; with "
                        "distributed.reshard_after_forward=false, like ZeRO-2; distributed.cpu_offload=true, like "
                        "ZeRO-Offload), launched with an accelerate config without deepspeed, or torchrun "
                        "(docs/distributed.md)")
    if environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise UserError("this accelerate config turns on accelerate's FSDP: gpupoor applies FSDP2 itself, so that "
                        "its checkpoints gather the weights and shard the optimizer state to match",
                        hint="launch with an accelerate config without fsdp (or with torchrun) and set "
                        "distributed.strategy: fsdp in the recipe (docs/distributed.md)")
    launched_by_accelerate = "ACCELERATE_USE_CPU" in environ or "ACCELERATE_MIXED_PRECISION" in environ
    ranked = any(key in environ for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK"))
    if launched_by_accelerate and "MASTER_ADDR" in environ and not ranked:
        raise UserError("accelerate launch started a single process although more were asked for: without "
                        "--multi_gpu (or with --cpu) it uses its one-process launcher, which expects mpirun",
                        hint="on CPUs: torchrun --nproc-per-node N -m gpupoor train RECIPE; on GPUs: accelerate "
                        "launch --multi_gpu --num_processes N -m gpupoor train RECIPE")


def smoke_recipe(recipe: Recipe) -> Recipe:
    """The same recipe shrunk for `--smoke`: a few rows, a few steps, CPU, fp32, no checkpoints."""
    few = {"max_rows": min(recipe.data.max_rows or SMOKE_ROWS, SMOKE_ROWS)}
    sources = [source.model_copy(update={"max_rows": min(source.max_rows or SMOKE_ROWS, SMOKE_ROWS),
                                         "eval_rows": min(source.eval_rows, 4), "rows": None, "epochs": None})
               for source in recipe.data.datasets] if recipe.data.datasets else None
    data = recipe.data.model_copy(update={
        **few, "datasets": sources, "max_length": min(recipe.data.max_length, SMOKE_MAX_LENGTH),
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


def total_steps(recipe: Recipe, batches_per_epoch: int, processes: int = 1) -> int:
    if recipe.training.max_steps is not None:
        return recipe.training.max_steps
    epochs = recipe.training.epochs if recipe.training.epochs is not None else 1.0
    per_step = recipe.training.gradient_accumulation_steps * processes  # micro-batches one optimizer step uses
    return max(1, math.ceil(epochs * batches_per_epoch / per_step))


def make_accelerator(device: str, precision: str, strategy: str = "single"):
    """The Accelerator: one process, or several under torchrun / accelerate launch. It prepares DDP itself;
    FSDP is applied by gpupoor.train.distributed.shard_model (accelerate builds FSDP on accelerators only)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state that refuses a second mixed precision. A second run in the same
    # process (the demo, tests, a notebook) must start from a clean one; accelerate has no public reset, so
    # this private call is the one place gpupoor needs it. Launch settings (DDP etc.) come from the
    # environment and survive.
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=device == "cpu",
                              mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision])
    if strategy == "fsdp" and accelerator.scaler is not None:
        # fp16 under FSDP: each process sees only its shard of the gradients, so whether a step had an inf must
        # be agreed by all of them (else one skips the step and another takes it). ShardedGradScaler does that.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        accelerator.scaler = ShardedGradScaler()
    return accelerator


# ----------------------------------------------------------------------------------------------------------
# Stages


@dataclass
class Session:
    """Everything one process built for a run, and its progress."""

    recipe: Recipe
    run_dir: Path
    smoke: bool
    accelerator: object
    choices: dict  # name -> gpupoor.hardware.Choice (device, precision, attention, sampler)
    tokenizer: object
    data: object  # gpupoor.data.build.DataBundle
    model: object  # as prepared by accelerate
    unwrapped: object
    raw_optimizer: object
    optimizer: object
    steps: int
    warmup: int
    summary: object  # gpupoor.model.build.ModelSummary
    nodes: int = 1
    logged: set = field(default_factory=set)  # (step, kind) of what earlier sessions logged (trackers.already_logged)
    scheduler: object = None
    state: object = None  # gpupoor.train.state.TrainState
    memory_plan: object = None
    teacher: object = None  # the frozen distillation teacher (recipe.distill)
    reference: object = None  # DPO's frozen reference copy (preference.reference: copy)
    startup: object = None  # gpupoor.run.startup.StartupClock: where the seconds before the first step went

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> str:
        return self.choices["device"].value

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def sharded(self) -> bool:
        return self.choices["strategy"].value == "fsdp"

    @property
    def full(self) -> bool:
        """`full` fine-tuning: checkpoints and final/ hold the whole model, not an adapter."""
        return self.recipe.peft.method == "full"

    def saved_weight_bytes(self) -> int:
        """About what save_weights writes: the trainable weights (an adapter), or for `full` every weight."""
        return sum(p.numel() * p.element_size() for p in self.unwrapped.parameters() if self.full or p.requires_grad)

    def gather_weights(self) -> dict | None:
        """Under FSDP, the trained weights gathered whole onto the first process (collective); else None: the
        model holds them whole already."""
        if not self.sharded:
            return None
        from gpupoor.train.distributed import gather_weights

        return gather_weights(self.model, whole_model=self.full)

    def save_weights(self, directory: Path, gathered: dict | None = None) -> None:
        """The trained weights in their standard layout: a PEFT adapter, or (full) a transformers model directory
        in safetensors shards that AutoModelForCausalLM.from_pretrained loads with no gpupoor. `gathered`: what
        gather_weights returned (FSDP)."""
        extra = {} if gathered is None else {"state_dict": gathered}
        if self.full:
            self.unwrapped.save_pretrained(directory, max_shard_size=FULL_SHARD_SIZE, **extra)
        else:
            self.unwrapped.save_pretrained(directory, safe_serialization=True, **extra)  # adapter config + weights
        self.tokenizer.save_pretrained(directory)


def build_session(recipe: Recipe, run_dir: Path, smoke: bool, say, resuming: bool = False, clock=None) -> Session:
    """Hardware choices, tokenizer, data, model and optimizer, in the order that keeps the RNG stream fixed.
    `resuming`: a checkpoint's weights will replace the starting ones. `clock`: a gpupoor.run.startup.StartupClock
    already running (a new one otherwise)."""
    from gpupoor.run.startup import StartupClock

    clock = clock or StartupClock()
    import torch

    from gpupoor import faults
    from gpupoor.data.build import build_data
    from gpupoor.decisions import choose_strategy, launch_layout
    from gpupoor.hardware import (resolve_attention, resolve_device, resolve_precision, resolve_sampler,
                                  usable_cpu_count)
    from gpupoor.model.build import build_model, summarize
    from gpupoor.model.load import load_tokenizer, model_location
    from gpupoor.train.optim import build_optimizer, warmup_steps
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()
    clock.mark("libraries")
    device = resolve_device(recipe.training.device)
    precision = resolve_precision(recipe.precision, device.value)
    attention = resolve_attention(recipe.model.attention, device.value)
    processes, nodes = launch_layout(os.environ)
    strategy = choose_strategy(recipe.distributed.strategy, processes)
    # The Accelerator first: under `accelerate launch` it says which GPU this process owns.
    accelerator = make_accelerator(device.value, precision.value, strategy.value)
    if not accelerator.is_main_process:
        say = lambda *args, **kwargs: None  # noqa: E731 -- one process reports
    if device.value == "cpu":
        # Oversubscribed cores are far slower than idle ones: use the cores we may run on, no more, shared with
        # the other processes of this node.
        per_process = max(1, usable_cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(recipe.training.cpu_threads or per_process)
    torch.manual_seed(recipe.seed)

    location = model_location(recipe.model, Path.cwd())  # a local directory (built-ins built) or a hub id
    tokenizer = load_tokenizer(location, recipe.model)
    clock.mark("accelerator and tokenizer")
    sampler = resolve_sampler(recipe.data.sampler, attention.value, recipe.model.trust_remote_code)
    data = build_data(recipe.data, tokenizer, recipe.training.micro_batch_size, recipe.seed, Path.cwd(),
                      sampler=sampler.value, resuming=resuming)
    clock.mark("data")
    for warning in data.warnings:
        say(f"warning: {warning}")
    chat_source = next((s for s in recipe.data.sources() if s.format in ("chat", "sharegpt")), None)
    if chat_source is not None:
        from gpupoor.data.build import make_encoder

        # The tokenizer saved beside the adapter carries the template the run trained with (a named one resolved
        # to its text), so generate, merges and plain transformers render prompts the same way.
        tokenizer.chat_template = make_encoder(recipe.data, tokenizer, chat_source).chat_template
    model = build_model(location, recipe.model, recipe.peft, quant=recipe.quantization, memory=recipe.memory,
                        precision=precision.value, attention=attention.value, device=str(accelerator.device),
                        seed=recipe.seed, smoke=smoke, resuming=resuming)
    summary = summarize(model)
    teacher = _build_teacher(recipe, tokenizer, precision.value, attention.value, str(accelerator.device), smoke)
    reference = _build_reference(recipe, precision.value, attention.value, str(accelerator.device), smoke)
    clock.mark("model")
    faults.at_stage("startup")  # tests: a signal while the model loads
    if strategy.value == "fsdp":  # before the optimizer: sharding replaces the parameters it must hold
        from gpupoor.train.distributed import shard_model

        dist = recipe.distributed
        model = shard_model(model, precision.value, device.value, dist.shard_frozen, dist.reshard_after_forward,
                            dist.cpu_offload)
    raw_optimizer = build_optimizer(recipe.training, model, device.value)
    steps = total_steps(recipe, len(data.plan), accelerator.num_processes)
    if strategy.value == "fsdp":
        prepared_model, optimizer = model, accelerator.prepare(raw_optimizer)
    else:
        prepared_model, optimizer = accelerator.prepare(model, raw_optimizer)  # DDP-wrapped with several processes
    clock.mark("optimizer")
    choices = {"device": device, "precision": precision, "attention": attention, "sampler": sampler,
               "strategy": strategy}
    return Session(recipe, run_dir, smoke, accelerator, choices, tokenizer, data, prepared_model,
                   accelerator.unwrap_model(prepared_model), raw_optimizer, optimizer, steps,
                   warmup_steps(recipe.training, steps), summary, nodes=nodes, teacher=teacher, reference=reference,
                   startup=clock)


def _build_teacher(recipe: Recipe, tokenizer, precision: str, attention: str, device: str, smoke: bool):
    """The frozen distillation teacher (recipe.distill), checked to share the student's vocabulary; or None."""
    if recipe.distill is None:
        return None
    from gpupoor.objectives.distill import check_vocabularies
    from gpupoor.model.frozen import build_teacher

    teacher, teacher_tokenizer = build_teacher(recipe.distill, recipe.model, precision=precision, attention=attention,
                                               device=device, seed=recipe.seed, smoke=smoke)
    check_vocabularies(tokenizer, teacher_tokenizer)
    return teacher


def _build_reference(recipe: Recipe, precision: str, attention: str, device: str, smoke: bool):
    """DPO's frozen reference copy of the base model when the reference is a copy (gpupoor.decisions
    .choose_reference), else None."""
    from gpupoor.decisions import choose_reference

    preference = recipe.preference
    if choose_reference(recipe.training.objective, preference.reference, recipe.peft.method).value != "copy":
        return None
    from gpupoor.model.frozen import build_reference

    return build_reference(recipe.model, bits=preference.reference_bits, quant=recipe.quantization,
                           precision=precision, attention=attention, device=device, seed=recipe.seed, smoke=smoke)


def check_checkpoint_matches(session: Session, checkpoint) -> None:
    """Refuse (unless --force) a checkpoint written for other data or other trajectory settings."""
    from gpupoor.recipe.diff import trajectory_hash

    if checkpoint.manifest.get("data_fingerprint") not in (None, session.data.fingerprint):
        raise UserError("the training data (or tokenizer, format or max_length) is not what this run was "
                        f"trained on: its fingerprint changed since checkpoint {checkpoint.path.name}",
                        hint="restore the original data, or pass --force to continue on the new data")
    if checkpoint.manifest.get("recipe_hash") not in (None, trajectory_hash(session.recipe)):
        raise UserError(f"run_dir/recipe.yaml no longer describes the run that wrote {checkpoint.path.name} "
                        "(its trajectory settings were edited)",
                        hint="restore them, or pass --force to continue with the edited recipe")
    saved, now = checkpoint.manifest.get("processes", 1), session.accelerator.num_processes
    if saved != now:
        # Each process draws its own micro-batches and the gradients meet by all-reduce: another count takes
        # other micro-batches per optimizer step (and another step count per epoch).
        raise UserError(f"these changes alter the training trajectory, so the result would no longer be the run "
                        f"that was started:\n  processes: {saved} -> {now} (checkpoint {checkpoint.path.name} "
                        "was written by a run on " f"{saved} process{'es' if saved != 1 else ''})",
                        hint=f"launch {saved} process{'es' if saved != 1 else ''} again (e.g. torchrun --nproc-per-node "
                        f"{saved}), or pass --force to continue on {now} (the data position carries over; the "
                        "optimizer state is resharded)")


def _check_models(session: Session, checkpoint, force: bool, say) -> tuple[dict, dict[str, str]]:
    """The identity of each model the run loads (gpupoor.model.identity), taken by the first process (it writes the
    checkpoints) and sent to the others, and what changed since the checkpoint recorded them: refused unless
    --force, which accepts them. Every process gets the same verdict, so a refusal ends them all with exit 2
    (the others would otherwise go on into the next collective alone). Returns (identities, changes by key)."""
    if session.smoke:
        return {}, {}
    verdict: object = None
    if session.main:
        try:
            verdict = _model_verdict(session, checkpoint)
        except Exception as exc:  # a file that cannot be read: said by every process, not only the first
            verdict = exc
    if session.accelerator.num_processes > 1:
        import torch.distributed as dist

        sent = [verdict if not isinstance(verdict, Exception) else RunFailed(str(verdict))]
        dist.broadcast_object_list(sent, src=0)  # a sync point: the others wait while the first hashes
        verdict = verdict if session.main else sent[0]
    if isinstance(verdict, Exception):
        raise verdict
    models, changes = verdict
    listed = "\n".join(f"  {key}: {change}" for key, change in changes.items())
    if changes and not force:
        raise UserError(f"the model{'s' if len(changes) > 1 else ''} this run trained with changed at the same path "
                        f"since checkpoint {checkpoint.path.name}; resuming would continue on other weights:\n{listed}",
                        hint="restore the original files, or pass --force to accept the new ones (the next "
                        "checkpoint records them)")
    if changes:
        say(f"warning: --force: resuming with changed models (recorded from now on):\n{listed}")
    return models, changes


def _model_verdict(session: Session, checkpoint) -> tuple[dict, dict[str, str]]:
    """(identities, changes since the checkpoint's record) of the models the recipe names."""
    from gpupoor.model.identity import model_changes, model_identities

    recorded = checkpoint.manifest.get("models") if checkpoint is not None else None
    models = model_identities(session.recipe, recorded)
    session.startup.mark("model")  # identifying the model's files counts as loading them
    return models, model_changes(recorded, models)


def restore(session: Session, checkpoint, force: bool) -> None:
    """Load a checkpoint's adapter, optimizer (and GradScaler) state and progress; then build the schedule at
    the restored step. `checkpoint` None: a new run at step 0. (latest_valid verified every listed file.)"""
    from gpupoor.train.optim import build_scheduler
    from gpupoor.train.state import TrainState

    session.state = TrainState()
    if checkpoint is not None:
        from gpupoor.storage.checkpoint import STATE, load_torch
        from gpupoor.train.distributed import load_optimizer

        load_trained_weights(session, checkpoint.path)
        # Into the bare optimizer: accelerate's wrapper adds nothing to its state.
        load_optimizer(session.unwrapped, session.raw_optimizer, checkpoint.path)
        scaler = session.accelerator.scaler
        if scaler is not None and (checkpoint.path / "scaler.pt").is_file():
            scaler.load_state_dict(load_torch(checkpoint.path / "scaler.pt"))
        if force:
            _apply_hyperparameters(session.recipe, session.optimizer)
        session.state = TrainState.from_dict(json.loads((checkpoint.path / STATE).read_text()))
        session.warmup = _resumed_warmup(session, checkpoint, force)
    # Built after the optimizer state is restored: it starts at the current step of the schedule for `steps`.
    session.scheduler = build_scheduler(session.recipe.training, session.raw_optimizer, session.steps,
                                        session.warmup, session.state.step)


def _resumed_warmup(session: Session, checkpoint, force: bool) -> int:
    """The run's own warmup, which never restarts when a resume extends the run: as its manifest records it, or
    (older checkpoints; --force with new warmup settings) computed from the total the checkpoint was written for."""
    from gpupoor.train.optim import warmup_steps

    if "warmup_steps" in checkpoint.manifest and not force:
        return checkpoint.manifest["warmup_steps"]
    return warmup_steps(session.recipe.training, checkpoint.manifest.get("total_steps", session.steps))


def load_trained_weights(session: Session, directory: Path) -> None:
    """A checkpoint's adapter (or, `full`, its whole model) into the built model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from gpupoor.storage.checkpoint import ADAPTER

    device = session.accelerator.device
    device = "cpu" if device.type == "cpu" else str(device)  # safetensors refuses "cpu:0" (torchrun on CPUs)
    if session.full:
        load_model_weights(session.unwrapped, directory, device, sharded=session.sharded)
        return
    weights = load_file(directory / ADAPTER, device=device)
    if session.sharded:
        from gpupoor.train.distributed import load_weights

        unexpected = load_weights(session.model, weights, adapter=True)
    else:
        unexpected = getattr(set_peft_model_state_dict(session.unwrapped, weights), "unexpected_keys", None)
    if unexpected:
        raise UserError(f"checkpoint {directory.name} does not fit this model: unexpected {unexpected[:3]}")


def load_model_weights(model, directory: Path, device: str, sharded: bool = False) -> None:
    """A full fine-tune's checkpoint into the built model, shard by shard. Only weights tied to another one (the
    output head tied to the embeddings, which save_pretrained writes once) may be absent."""
    from safetensors.torch import load_file

    from gpupoor.storage.shards import MODEL_INDEX
    from gpupoor.train.distributed import load_weights

    index = directory / MODEL_INDEX
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    missing: set[str] = set(model.state_dict())
    for shard in shards:
        weights = load_file(directory / shard, device=device)
        if sharded:
            unexpected = load_weights(model, weights, adapter=False)
        else:
            unexpected = model.load_state_dict(weights, strict=False).unexpected_keys
        if unexpected:
            raise UserError(f"checkpoint {directory.name} does not fit this model: unexpected {unexpected[:3]}")
        missing -= set(weights)
    tied = {name for name in missing if name.endswith("lm_head.weight")
            and getattr(model.config, "tie_word_embeddings", False)}
    if missing - tied:
        raise UserError(f"checkpoint {directory.name} lacks weights of this model, e.g. {sorted(missing - tied)[:3]}")


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


def print_summary(session: Session, say, checkpoint, loss_path: str) -> None:
    """The startup summary: what was chosen and why, the data, the steps, the memory plan."""
    recipe, data, choices, summary = session.recipe, session.data, session.choices, session.summary
    stats, processes = data.train.stats, session.accelerator.num_processes
    verb = "smoke test" if session.smoke else ("resume" if checkpoint is not None else "train")
    say(f"gpupoor {verb}: {recipe.model.name_or_path}" + (" (shrunken random-weight copy)" if session.smoke else ""))
    say("  " + "; ".join(f"{name} {choices[name].value} ({choices[name].reason})"
                         for name in ("device", "precision", "attention")))
    strategy = choices["strategy"]
    nodes = f" on {session.nodes} nodes" if session.nodes > 1 else ""
    say(f"  processes: {processes}{nodes}" + (f" ({strategy.value.upper()}, {session.accelerator.state.backend}; "
                                               f"{strategy.reason})" if processes > 1 else " (no data parallelism)"))
    checkpointing = {False: "off", True: "on (non-reentrant)",
                     "offload": "on, layer inputs offloaded to CPU" if session.device == "cuda"
                     else "on (offload has no effect on a CPU)"}[recipe.memory.gradient_checkpointing]
    say(f"  loss: {loss_path}; gradient checkpointing: {checkpointing}")
    peft = recipe.peft
    scope = [f"the last {peft.last_layers} decoder layers" if peft.last_layers else
             ("" if peft.method == "full" and peft.modules_to_save else "every decoder layer")] + peft.modules_to_save
    say(f"  method {peft.method} on {' and '.join(filter(None, scope))}; parameters {summary.total_params:,}; trainable "
        f"{summary.trainable_params:,} ({summary.trainable_percent:.2f}%); weights {summary.weight_bytes / 2**20:.1f} MiB")
    noun = "preference pairs" if data.pairs else "examples"
    say(f"  data {stats.kept} {noun} ({stats.rows} rows; {stats.truncated} truncated to "
        f"{recipe.data.max_length} tokens; {stats.dropped_no_target} without targets dropped); "
        f"{stats.target_tokens / max(stats.tokens, 1):.0%} of tokens are targets"
        + ("; tokenized cache hit" if data.cache_hit else "")
        + (f"; eval {len(data.eval)} {noun}" if data.eval is not None else ""))
    mixture = data.mixture
    if mixture is not None and len(mixture.sources) > 1:
        for source, part in zip(mixture.sources, data.source_stats):
            say(f"    source {source.name}: {part.rows} rows, {source.size} examples, {part.tokens:,} tokens "
                f"({part.target_tokens:,} targets); {source.count} examples per epoch"
                + (f"; eval {source.eval_end - source.eval_start}" if source.eval_end > source.eval_start else ""))
    sampler = choices["sampler"]
    # Packed, a micro-batch is rows holding as many whole examples (pairs) as fit: say how many that makes.
    per_batch = f" (about {len(data.train) / max(len(data.plan), 1):.1f} {noun} each)" if sampler.value == "packed" else ""
    unit = (f"{recipe.training.micro_batch_size} packed rows of up to {data.plan.row_length} tokens{per_batch}"
            if sampler.value == "packed" else f"{recipe.training.micro_batch_size} {noun}")
    say(f"  {session.steps} optimizer steps of {recipe.training.gradient_accumulation_steps} x {unit}; "
        f"{len(data.plan)} micro-batches per epoch; sampler {sampler.value} ({sampler.reason})")
    if session.memory_plan is not None:
        from gpupoor.units import format_bytes

        plan = session.memory_plan
        fits = "" if plan.fits is None else (" (fits)" if plan.fits else " (predicted NOT to fit)")
        say(f"  memory plan: peak {format_bytes(plan.peak)} on {plan.device}{fits}; "
            f"activations {format_bytes(next(t.bytes for t in plan.terms if t.key == 'activations'))} "
            "(gpupoor plan RECIPE for every term)")
    if checkpoint is not None:
        state = session.state
        say(f"  resuming from {checkpoint.path.name}: step {state.step}, epoch {state.epoch}, "
            f"micro-batch {state.batch_in_epoch} of the epoch")
    say(f"  run directory {session.run_dir}")
    if session.startup is not None:
        say(f"  {session.startup.line()}")


def open_run_dir(session: Session, lock: RunLock | None, started: float, say=print) -> RunLock | None:
    """Create and lock a new run's directory (a resume holds its lock already), then commit the recipe, trim
    metrics the resumed steps will write again, and record this session. Returns a lock this call took."""
    from gpupoor.storage.rundir import METRICS
    from gpupoor.train.loop import eval_due
    from gpupoor.train.metrics import read_metrics, truncate_metrics
    from gpupoor.train.trackers import already_logged

    owned = None
    if lock is None and session.main:  # a new run: create and lock it, then make sure no other run got there first
        session.run_dir.mkdir(parents=True, exist_ok=True)
        owned = RunLock(session.run_dir).acquire()
        if holds_something(session.run_dir):
            owned.release()
            check_run_dir(session.run_dir)
    session.accelerator.wait_for_everyone()
    if not session.main:
        return owned
    try:
        # Only now, with everything built and loaded, is the (possibly changed) recipe committed.
        store_recipe(session.run_dir, session.recipe)
        step = session.state.step
        # The eval of the checkpoint's step is dropped only where the loop will run it again (an eval point, or
        # the last step, whose eval follows the loop): a crash between checkpoint and eval record loses nothing.
        redone = step > 0 and session.state.evaluated_step < step and \
            (step >= session.steps or eval_due(session.data, loop_settings(session, None), step))
        # Lines that are not records (edited by hand, a disk error) never block a resume: the rewrite drops them.
        records = read_metrics(session.run_dir / METRICS,
                               lambda text: say(f"{text}; the resume rewrites it without them"))
        session.logged = already_logged(records)
        truncate_metrics(session.run_dir / METRICS, records, step, redone)
        write_session(session.run_dir, session.recipe.checkpoint.time_limit_s, started)
    except BaseException:
        if owned is not None:  # a new run that could not start (a full disk): its .lock alone is no run
            owned.release()
        raise
    return owned


# ----------------------------------------------------------------------------------------------------------
# Training: the loop's hooks, and when to checkpoint


ASSUMED_WRITE_BYTES_PER_S = 100 * 2**20  # save-time guess until the first checkpoint is measured
MIN_SAVE_RESERVE_S = 1.0  # a save also writes the tokenizer and fsyncs: never assume less than this


@dataclass
class CheckpointPolicy:
    """When to save (every N steps, every M minutes), how long a save takes (measured, or guessed from its
    size), and so how much time a time limit must keep in reserve to land the last checkpoint."""

    every_steps: int | None
    interval_minutes: float | None
    time_limit_s: float | None
    started: float  # time.monotonic() when the command began
    expected_bytes: int  # size of the next checkpoint (measured after the first)
    last_time: float = field(default_factory=time.monotonic)
    last_step: int = 0
    save_s: float = 0.0  # seconds the last save took (0: none yet)

    def due(self, step: int, total_steps: int) -> bool:
        if step >= total_steps:
            return False  # the end of the run saves anyway
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        by_time = bool(self.interval_minutes) and time.monotonic() - self.last_time >= 60 * self.interval_minutes
        return by_steps or by_time

    def saved(self, step: int, seconds: float | None, size: int | None) -> None:
        if seconds is not None:
            self.save_s = seconds
        if size is not None:
            self.expected_bytes = size
        self.last_time, self.last_step = time.monotonic(), step

    def out_of_time(self, last_step_s: float) -> bool:
        """Keep twice the save time plus one step in reserve, so the checkpoint lands before the deadline."""
        if self.time_limit_s is None:
            return False
        save_s = self.save_s or max(MIN_SAVE_RESERVE_S, self.expected_bytes / ASSUMED_WRITE_BYTES_PER_S)
        return time.monotonic() - self.started + 2 * save_s + last_step_s >= self.time_limit_s


class RunHooks:
    """What happens at each step boundary of the loop: metrics, progress, checkpoints, stopping."""

    def __init__(self, session: Session, policy: CheckpointPolicy, stop, manifest_base: dict, resumed: bool = False):
        import time as clock

        from gpupoor.train.metrics import MetricsWriter, NullWriter, Progress

        self.session, self.policy, self.stop, self.manifest_base = session, policy, stop, manifest_base
        self.first_step = session.state.step  # the step this process started from
        self.last_loss: float | None = None
        self.warned_nonfinite = False
        self.predicted_mb = (round(session.memory_plan.comparable_peak / 2**20, 1)
                             if session.memory_plan is not None else None)
        main = session.main
        self.metrics = MetricsWriter(session.run_dir / "metrics.jsonl") if main else NullWriter()
        self.progress = Progress(session.steps, session.state.step, session.recipe.logging.progress if main else "none",
                                 session.recipe.logging.every_steps)
        self.trackers = self.profiler = self._rngs = None
        if main and session.recipe.logging.report_to:
            from gpupoor.train.trackers import Trackers

            self.trackers = Trackers(session.run_dir, session.recipe.logging, session.recipe.model_dump(mode="json"),
                                     session.logged, lambda text: self.progress.message(text, always=True))
        self.write({"step": self.first_step, "event": "start", "session": "resume" if resumed else "train",
                    "time": round(clock.time(), 3), "startup_s": session.startup.seconds()})

    def write(self, record: dict) -> None:
        """One record to metrics.jsonl (the record of truth) and to the trackers."""
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def on_step(self, record: dict, state) -> None:
        from gpupoor import faults

        if self.predicted_mb is not None:
            record["predicted_peak_mb"] = self.predicted_mb
        if state.step - self.first_step in (1, 3) and self.session.main:
            self._memory_line(record, state.step)
        self.last_loss = record["loss"]
        self.write(record)
        if record.get("nonfinite") and not self.warned_nonfinite:  # once per session; the end repeats the count
            self.warned_nonfinite = True
            self.progress.message(f"warning: step {record['step']} was skipped: its loss ({record['loss']:.4g}) or "
                                  f"gradient norm ({record['grad_norm']:.4g}) is not finite. "
                                  f"{nonfinite_advice(self.session.recipe)}", always=True)
        self.progress.step(record)
        if self.profiler is not None:
            self.profiler.step(record)
        if self._anywhere(self.policy.due(state.step, self.session.steps)):  # each process has its own clock
            self.save_checkpoint()
        faults.after_step(state.step)

    def _memory_line(self, record: dict, step: int) -> None:
        """After the first step (optimizer state now exists) and the third (the heap has settled)."""
        from gpupoor.train.optim import optimizer_state_bytes

        if step - self.first_step == 1:
            record["optimizer_state_mb"] = round(optimizer_state_bytes(self.session.optimizer) / 2**20, 2)
        what = "process RSS" if self.session.device == "cpu" else "allocated, without context and allocator slack"
        planned = self.predicted_mb
        versus = "" if planned is None else \
            f" vs {planned:.0f} MiB planned ({record['peak_mem_mb'] / planned - 1:+.0%}; {what})"
        state_text = f"optimizer state {record['optimizer_state_mb']:.1f} MiB; " if "optimizer_state_mb" in record else ""
        self.progress.message(f"  {state_text}peak memory after step {step}: {record['peak_mem_mb']:.0f} MiB{versus}",
                              always=True)

    def on_eval(self, record: dict, state) -> None:
        self.write(record)
        self.progress.message(f"step {record['step']}: eval_loss {record['eval_loss']:.4f}, "
                              f"accuracy {record['eval_accuracy']:.1%}")
        if record["step"] > state.evaluated_step:  # judge each eval once
            self._judge(record["eval_loss"], state)

    def _judge(self, loss: float, state) -> None:
        """Early stopping and the best checkpoint. Any fall of eval_loss makes a new best; only a fall of at least
        early_stopping_min_delta resets the count of evaluations without improvement."""
        training, keep_best = self.session.recipe.training, self.session.recipe.checkpoint.keep_best
        state.evaluated_step = state.step
        best = state.best_eval_loss
        if best is None or loss < best - training.early_stopping_min_delta:
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
        if best is None or loss < best:
            state.best_eval_loss, state.best_step = loss, state.step
            if keep_best:
                # Every process knows whether this step is saved (the policy's record is common): the save is
                # collective under FSDP.
                name = f"step-{state.step:06d}" if self.policy.last_step == state.step else self.save_checkpoint()
                self.write({"step": state.step, "event": "best", "checkpoint": name, "best_eval_loss": loss})

    def best_checkpoint(self) -> str | None:
        state = self.session.state
        keep = self.session.recipe.checkpoint.keep_best and state.best_step is not None
        return f"step-{state.best_step:06d}" if keep else None

    def should_stop(self, state, last_step_s: float) -> str | None:
        from gpupoor import faults

        signal = self.stop.requested
        out_of_time = self.policy.out_of_time(last_step_s) or state.step in faults.steps_for("timeout")
        accelerator = self.session.accelerator
        if accelerator.num_processes > 1:
            # Every process must stop at the same step: a signal may reach one process only, and each measures
            # its own time. One all-reduce per step boundary (a sync point) makes the decision common.
            import torch

            flags = torch.tensor([float(signal), float(out_of_time)], device=accelerator.device)
            signal, out_of_time = (bool(x) for x in accelerator.reduce(flags, "sum").tolist())
        patience = self.session.recipe.training.early_stopping_patience
        if patience and state.evals_without_improvement >= patience:  # the same on every process: evals are reduced
            return "early_stop"
        if signal:
            return self.stop.name or "stop requested on another process"
        return "time_limit" if out_of_time else None

    def save_checkpoint(self) -> str:
        """Commit checkpoints/step-N for the current state; rotate older ones. Returns its name.

        With several processes the collective part comes first (FSDP: every process sends its share of the
        weights to the first and writes its own shard of the optimizer state into a staging folder), then the
        first process alone commits the checkpoint (weights, optimizer, progress, manifest last, one rename), and
        all processes learn whether it landed: a failure stops every process, not only the one that saw it."""
        from gpupoor.storage.checkpoint import CheckpointError, write_checkpoint
        from gpupoor.train.distributed import local_values
        from gpupoor.storage.files import dir_size

        session, step = self.session, self.session.state.step
        name = f"step-{step:06d}"
        finite = all(local_values(p).isfinite().all() for p in session.unwrapped.parameters() if p.requires_grad)
        if self._anywhere(not finite):
            raise RunFailed(f"refusing to save {name}: the trainable weights are not finite")
        gathered = session.gather_weights()
        self._rngs = self._gather_rngs()
        staged = own = None  # own: this process's error
        try:
            staged = self._stage_optimizer(name)
        except Exception as exc:  # DCP raises on every process (distributed.dcp_error); other writes fail alone
            own = exc
        if self._anywhere(own is not None):  # before any further collective: every process stops here
            if session.main:
                shutil.rmtree(self._staging(name), ignore_errors=True)  # every process is done writing into it
            raise self._failed(session.checkpoints_dir / name, own)
        seconds = size = None
        if session.main:
            try:
                seconds = write_checkpoint(session.checkpoints_dir / name,
                                           functools.partial(self._save_files, gathered=gathered, staged=staged),
                                           step, {**self.manifest_base, "loss": self.last_loss},
                                           int(self.policy.expected_bytes * 1.1) - (dir_size(staged) if staged else 0))
                size = dir_size(session.checkpoints_dir / name)
            except Exception as exc:  # the others must learn of it below, or they would wait for it forever
                own = exc
            else:
                self._rotate(step)
            finally:
                if staged is not None:
                    shutil.rmtree(staged, ignore_errors=True)  # moved into the checkpoint, or abandoned
        # Whether it landed, and its size from the first process: every process estimates the next save alike.
        failed, size = self._summed(float(own is not None), float(size or 0))
        if failed:
            failure = self._failed(session.checkpoints_dir / name, own)  # collective: every process, first
            if own is not None and not isinstance(own, (CheckpointError, OSError)):
                raise own  # a bug, not the disk: the first process reports it as it is (--debug: the traceback)
            raise failure
        self.policy.saved(step, seconds, int(size))
        self.write({"step": step, "checkpoint": name, "save_s": round(self.policy.save_s, 3)})
        return name

    def _rotate(self, step: int) -> None:
        """Remove checkpoints beyond keep_last. The new one has landed, so a failure here (a file that cannot be
        removed) costs disk space, not work: a warning, never a failed save."""
        from gpupoor.storage.checkpoint import rotate

        try:
            rotate(self.session.checkpoints_dir, self.session.recipe.checkpoint.keep_last, step,
                   keep=self.best_checkpoint())
        except OSError as exc:
            self.progress.message(f"warning: could not remove an old checkpoint ({exc}); the new one landed: "
                                  "remove the old one by hand to free its space", always=True)

    def _failed(self, target: Path, error: Exception | None) -> RunFailed:
        """Writing `target` (a checkpoint, final/) failed on some process, as every process agreed: the same
        one-line error for all, the first failing process's (gathered), after which none enters a collective."""
        text = self._failure_text(target, error) if error is not None else None
        processes = self.session.accelerator.num_processes
        if processes > 1:
            import torch.distributed as dist

            texts: list = [None] * processes
            dist.all_gather_object(texts, text)
            text = next(text for text in texts if text is not None)
        # Like a finished run, each process exits with its own code (1) instead of dying of the SIGTERM a launcher
        # sends the others when the first one exits.
        self.stop.finished = True
        return RunFailed(text)

    def _failure_text(self, target: Path, error: Exception) -> str:
        """A failed save in one line: a full disk with where, what the checkpoint needs and what is free; another
        error as it was (an OSError names its path)."""
        from gpupoor.storage.checkpoint import CheckpointError, disk_full, is_disk_full

        run_dir = self.session.run_dir
        if is_disk_full(error):
            error = disk_full(target, int(self.policy.expected_bytes * 1.1))
        if isinstance(error, CheckpointError):  # the disk: its text says what was needed and that nothing was lost
            return f"{error}\n  free some space, then continue with: gpupoor resume {run_dir}"
        return (f"could not write {target.relative_to(run_dir)}: {error}\n  the previous checkpoint is intact; "
                f"continue with: gpupoor resume {run_dir}")

    def _gather_rngs(self) -> list | None:
        """Several processes: every process's RNG state, by rank (each draws its own dropout masks, so each
        resumes its own stream). Collective."""
        accelerator = self.session.accelerator
        if accelerator.num_processes == 1:
            return None
        import torch.distributed as dist

        from gpupoor.train.state import capture_rng

        states: list = [None] * accelerator.num_processes
        dist.all_gather_object(states, capture_rng())
        return states

    def _anywhere(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (one all-reduce: a sync point); one process: flag."""
        return self._summed(float(flag))[0] > 0

    def _summed(self, *values: float) -> list[float]:
        """Each value summed over the processes (one all-reduce: a sync point); one process: the values."""
        accelerator = self.session.accelerator
        if accelerator.num_processes == 1:
            return list(values)
        import torch

        summed = accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=accelerator.device), "sum")
        return summed.tolist()

    def _stage_optimizer(self, name: str) -> Path | None:
        """FSDP: every process writes its shard of the optimizer state into a staging folder beside the
        checkpoints (removed by the next resume's sweep if a crash leaves it). None otherwise."""
        from gpupoor import faults

        session, step = self.session, self.session.state.step
        if not session.sharded:
            faults.at_stage("gathered", step)
            return None
        from gpupoor.train.distributed import save_optimizer

        staged = self._staging(name)
        # The fault point is where a process's own write begins, inside DCP, which agrees on failures itself.
        save_optimizer(session.model, session.raw_optimizer, staged, session.main,
                       before_write=lambda: faults.at_stage("gathered", step))
        return staged

    def _staging(self, name: str) -> Path:
        from gpupoor.storage.checkpoint import TMP_PREFIX

        return self.session.checkpoints_dir / f"{TMP_PREFIX}{name}-optimizer-shards"

    def _save_files(self, tmp: Path, gathered: dict | None = None, staged: Path | None = None) -> None:
        import torch

        from gpupoor import faults
        from gpupoor.storage.checkpoint import STATE
        from gpupoor.train.distributed import DCP_OPTIMIZER, TORCH_OPTIMIZER
        from gpupoor.train.state import capture_rng

        session, step = self.session, self.session.state.step
        session.save_weights(tmp, gathered)
        faults.at_stage("weights", step)
        if staged is not None:
            os.rename(staged, tmp / DCP_OPTIMIZER)  # the same filesystem: the shards move, nothing is copied
        else:
            torch.save(session.optimizer.state_dict(), tmp / TORCH_OPTIMIZER)
        if session.accelerator.scaler is not None:
            torch.save(session.accelerator.scaler.state_dict(), tmp / "scaler.pt")
        faults.at_stage("optimizer", step)
        session.state.rng = capture_rng()
        session.state.rng_by_rank = self._rngs or []
        (tmp / STATE).write_text(json.dumps(session.state.to_dict()))
        faults.at_stage("state", step)

    def close(self) -> None:
        self.progress.close()
        if self.trackers is not None:
            self.trackers.close()
        self.metrics.close()


def loop_settings(session: Session, loss_fn, eval_fn=None):
    from gpupoor.train.loop import LoopSettings

    from gpupoor.data.build import count_pairs, count_targets
    from gpupoor.objectives.preference import METRICS

    training = session.recipe.training
    pairs = training.objective != "sft"  # the loss is a sum over pairs, normalized by pairs
    return LoopSettings(total_steps=session.steps, accumulation=training.gradient_accumulation_steps,
                        max_grad_norm=training.max_grad_norm, eval_every=training.eval_every_steps,
                        pad_id=session.tokenizer.pad_token_id, eval_micro_batch_size=training.micro_batch_size,
                        # bitsandbytes 4-bit layers repack their weights in eval mode on some CPUs
                        eval_in_train_mode=session.recipe.quantization.bits is not None and session.device == "cpu",
                        max_consecutive_skips=training.max_consecutive_skips, loss_fn=loss_fn,
                        **({"eval_fn": eval_fn} if eval_fn is not None else {}), lockstep=session.sharded,
                        count_units=count_pairs if pairs else count_targets,
                        metric_names=METRICS.get(training.objective, ()))


def choose_loss(session: Session):
    """(training loss, eval sums (cross-entropy and correct targets), how the startup summary names the loss).
    Fault injection may make chosen steps non-finite. With distillation eval stays the cross-entropy,
    comparable across runs."""
    from gpupoor import faults
    from gpupoor.objectives.cross_entropy import find_fused_head, fused_eval_sums, fused_loss_sum, plain_eval_sums, plain_loss_sum

    fused, reason = find_fused_head(session.unwrapped, enabled=session.recipe.memory.fused_cross_entropy)
    cross_entropy = functools.partial(fused_loss_sum, fused=fused) if fused is not None else plain_loss_sum
    evaluation = functools.partial(fused_eval_sums, fused=fused) if fused is not None else plain_eval_sums
    name = f"{'fused chunked cross-entropy' if fused is not None else 'plain cross-entropy'} ({reason})"
    base_loss = cross_entropy
    if session.teacher is not None:
        base_loss, name = _distill_loss(session, fused)
    if session.recipe.training.objective != "sft":
        base_loss, evaluation, name = _preference_loss(session, fused, reason)
    nan_steps = faults.steps_for("nan")
    if not nan_steps:
        return base_loss, evaluation, name

    def loss_with_faults(model, batch):
        loss = base_loss(model, batch)
        if session.state.step + 1 not in nan_steps:
            return loss
        return (loss[0] * float("nan"), *loss[1:]) if isinstance(loss, tuple) else loss * float("nan")

    return loss_with_faults, evaluation, name


def _preference_loss(session: Session, head, reason: str):
    """DPO or ORPO on pairs (training and eval), with DPO's reference: the model with its adapter switched off, or
    the frozen copy build_session loaded."""
    from gpupoor.decisions import choose_reference
    from gpupoor.objectives.cross_entropy import find_fused_head
    from gpupoor.objectives.preference import PreferenceLoss, Reference, frozen_head

    recipe, preference = session.recipe, session.recipe.preference
    objective = recipe.training.objective
    choice = choose_reference(objective, preference.reference, recipe.peft.method)
    reference = None
    if choice.value == "adapter_off":
        # bitsandbytes 4-bit layers repack their weights in eval mode on some CPUs (as loop_settings' eval does)
        eval_mode = not (recipe.quantization.bits is not None and session.device == "cpu")
        reference = Reference(session.unwrapped, frozen_head(session.unwrapped, head), adapter_off=True,
                              eval_mode=eval_mode)
    elif choice.value == "copy":
        reference_head, _ = find_fused_head(session.reference, enabled=recipe.memory.fused_cross_entropy)
        # The copy stays in the mode gpupoor.model.build.build_reference chose (eval, but train for 4-bit on a CPU).
        reference = Reference(session.reference, reference_head, adapter_off=False, eval_mode=False)
    loss = PreferenceLoss(objective, head, reference, preference.beta, preference.loss_type,
                          preference.label_smoothing, preference.orpo_lambda)
    if objective == "dpo":
        smoothing = f", label smoothing {preference.label_smoothing:g}" if preference.label_smoothing else ""
        what = (f"DPO {preference.loss_type} (beta {preference.beta:g}{smoothing}); reference {choice.value} "
                f"({choice.reason})")
    else:
        what = f"ORPO (lambda {preference.orpo_lambda:g}; no reference model)"
    path = "fused chunked log-probabilities" if head is not None else "log-probabilities from full logits"
    return loss, loss.evaluate, f"{what}; {path} ({reason})"


def _distill_loss(session: Session, student_head):
    """The distillation loss: fused through both output heads where both can be, else from full logits."""
    from gpupoor.objectives.distill import distill_loss_sum, plain_distill_loss_sum
    from gpupoor.objectives.cross_entropy import find_fused_head

    distill, teacher = session.recipe.distill, session.teacher
    teacher_head, reason = find_fused_head(teacher, enabled=session.recipe.memory.fused_cross_entropy)
    settings = f"T {distill.temperature}, KL weight {distill.weight}, teacher {distill.teacher}"
    if student_head is not None and teacher_head is not None:
        def loss(model, batch):
            return distill_loss_sum(model, teacher, batch, student_head, teacher_head, distill.temperature,
                                    distill.weight)

        return loss, f"fused distillation KL + cross-entropy ({settings})"

    def plain(model, batch):
        return plain_distill_loss_sum(model, teacher, batch, distill.temperature, distill.weight)

    return plain, f"distillation KL + cross-entropy from full logits ({settings}; {reason})"


# ----------------------------------------------------------------------------------------------------------
# The run


def _execute(recipe: Recipe, run_dir: Path, checkpoint, smoke: bool, say, started: float,
             force: bool = False, lock: RunLock | None = None, plan=None, stop=None) -> RunResult:
    from gpupoor.run.startup import StartupClock

    clock = StartupClock()  # before the imports below: torch is among them
    from gpupoor import faults
    from gpupoor.storage.rundir import library_versions
    from gpupoor.recipe.diff import trajectory_hash
    from gpupoor.train.state import restore_rng

    session = build_session(recipe, run_dir, smoke, say, resuming=checkpoint is not None, clock=clock)
    if not session.main:
        say = lambda *args, **kwargs: None  # noqa: E731 -- one process reports
    if checkpoint is not None and not force:
        check_checkpoint_matches(session, checkpoint)
    elif checkpoint is not None and checkpoint.manifest.get("processes", 1) != session.accelerator.num_processes:
        say(f"warning: --force: processes {checkpoint.manifest.get('processes', 1)} -> "
            f"{session.accelerator.num_processes}: resuming on another layout (the optimizer state is resharded)")
    models, model_changes = _check_models(session, checkpoint, force, say)
    restore(session, checkpoint, force)
    if checkpoint is not None:
        session.startup.mark("restore")
    loss_fn, eval_fn, loss_path = choose_loss(session)
    if plan is not None and plan.device != session.device:  # planned for another device than torch found
        plan = _plan_quietly(LoadedRecipe(recipe, None), session.device)
    session.memory_plan = plan
    print_summary(session, say, checkpoint, loss_path)
    owned_lock = open_run_dir(session, lock, started, say)
    # The first checkpoint's size, until one is measured: the saved weights (the whole model for `full`) plus
    # the optimizer's two moments of what trains.
    params = list(session.unwrapped.parameters())
    trainable_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    weight_bytes = session.saved_weight_bytes()
    policy = CheckpointPolicy(recipe.checkpoint.every_steps, recipe.checkpoint.interval_minutes,
                              recipe.checkpoint.time_limit_s, started, weight_bytes + 2 * trainable_bytes + 2**20,
                              last_step=session.state.step)
    manifest_base = {"recipe_hash": trajectory_hash(recipe), "data_fingerprint": session.data.fingerprint,
                     "weights": "model" if session.full else "adapter",
                     "optimizer": "dcp" if session.sharded else "torch",
                     "processes": session.accelerator.num_processes, "strategy": session.choices["strategy"].value,
                     "total_steps": session.steps, "warmup_steps": session.warmup, "precision":
                     session.choices["precision"].value, "device": session.device, "versions": library_versions(),
                     "models": models}
    hooks = RunHooks(session, policy, stop, manifest_base, resumed=checkpoint is not None)
    for key, change in model_changes.items():  # accepted with --force: the next checkpoint records the new one
        hooks.write({"step": session.state.step, "event": "model_changed", "key": key, "change": change})
    if checkpoint is not None:
        # Last, so nothing above consumes the restored stream; each process its own when the checkpoint has them.
        by_rank, accelerator = session.state.rng_by_rank, session.accelerator
        restore_rng(by_rank[accelerator.process_index] if len(by_rank) == accelerator.num_processes
                    else session.state.rng)
    try:
        reason, name = _train(session, hooks, loss_fn, eval_fn)
    finally:
        hooks.close()
        if session.main:
            end_session(run_dir)
        if owned_lock is not None:
            owned_lock.release()
    return _finish(session, hooks, reason, name, started, say)


def _train(session: Session, hooks: RunHooks, loss_fn, eval_fn) -> tuple[str, str]:
    """Run the loop; always end on a committed checkpoint of the last step. Returns (why it stopped, its name)."""
    from gpupoor.train.loop import Hooks, TooManySkippedSteps, train

    try:
        with _profiler(session, hooks) as hooks.profiler:
            reason = train(session.model, session.optimizer, session.scheduler, session.accelerator, session.data,
                           session.state, loop_settings(session, loss_fn, eval_fn),
                           Hooks(on_step=hooks.on_step, on_eval=hooks.on_eval, should_stop=hooks.should_stop))
    except TooManySkippedSteps as exc:
        raise RunFailed(f"{exc}. The last good checkpoint is kept; lower training.learning_rate or check the "
                        f"data, then continue with: gpupoor resume {session.run_dir}") from None
    finally:
        hooks.progress.close()
    step = session.state.step
    name = f"step-{step:06d}"
    # Also at the end, so `resume --set training.max_steps=N` can extend; decided by all (the save is collective).
    if hooks._anywhere(hooks.policy.last_step != step or not (session.checkpoints_dir / name).is_dir()):
        name = hooks.save_checkpoint()
    state = session.state
    if reason == "early_stop":
        hooks.write({"step": step, "event": "early_stop", "best_step": state.best_step,
                     "best_eval_loss": state.best_eval_loss})
    elif reason != "done":
        hooks.write({"step": step, "event": "stop", "reason": reason})
    hooks.write({"step": step, "event": "end", "reason": reason, "skipped_steps": state.skipped_steps,
                 "nonfinite_steps": state.nonfinite_steps})
    return reason, name


def nonfinite_advice(recipe: Recipe) -> str:
    training = recipe.training
    clip = "" if training.max_grad_norm else ", set training.max_grad_norm (e.g. 1.0)"
    return f"Lower training.learning_rate (now {training.learning_rate:g}){clip}, or look for bad rows in the data"


def _nonfinite_warning(state, recipe: Recipe) -> str:
    """The end-of-session line when steps were skipped as non-finite: they did not update the weights."""
    return (f"warning: {state.nonfinite_steps} of {state.step} optimizer steps were skipped (a non-finite loss or "
            f"gradient norm; no update), so the run learned from {state.step - state.nonfinite_steps}. "
            + nonfinite_advice(recipe))


def _profiler(session: Session, hooks: RunHooks):
    """logging.profile_steps: a StepProfiler around the loop (RunHooks.on_step advances it), else nothing."""
    steps = session.recipe.logging.profile_steps
    if not steps:
        return contextlib.nullcontext()
    from gpupoor.profiling import StepProfiler

    return StepProfiler(steps, session.run_dir / "profile", session.device, session.accelerator.process_index,
                        session.main, lambda text: hooks.progress.message(text, always=True))


def _finish(session: Session, hooks: RunHooks, reason: str, name: str, started: float, say) -> RunResult:
    """The final adapter, or why the run stopped early and how to continue it."""
    from gpupoor import faults

    recipe, run_dir, state = session.recipe, session.run_dir, session.state
    if reason not in ("done", "early_stop"):
        faults.at_stage("stopped")
        # (no limit in the recipe when the stop came from elsewhere, e.g. GPUPOOR_FAULT=timeout@STEP)
        limit = f" {recipe.checkpoint.time_limit}" if recipe.checkpoint.time_limit else ""
        if reason == "time_limit" and state.step == hooks.first_step:
            raise UserError(f"checkpoint.time_limit{limit} is too short for one optimizer "
                            f"step: start-up took {time.monotonic() - started:.0f} s and a checkpoint needs "
                            "time in reserve, so every resume would stop here again",
                            hint=f"continue with a longer limit: gpupoor resume {run_dir} --time-limit DURATION "
                            f"(the checkpoint checkpoints/{name} keeps this run)")
        why = f"time limit{limit} nearly reached" if reason == "time_limit" else reason
        if state.nonfinite_steps:
            say(_nonfinite_warning(state, recipe))
        say(f"{why}: stopped after step {state.step} with checkpoint checkpoints/{name}\n"
            f"continue with: gpupoor resume {run_dir}")
        _all_finished(session, hooks)
        return RunResult(run_dir, reason, hooks.last_loss, state.step)
    best = hooks.best_checkpoint() if recipe.checkpoint.final == "best" else None
    if best is not None:
        from gpupoor.storage.checkpoint import verify

        problem = verify(session.checkpoints_dir / best)  # it is copied, so it is checked first
        if hooks._anywhere(problem is not None):
            say(f"warning: the best checkpoint {best} cannot become final/ ({problem or 'not found by every process'}"
                "): final/ holds the last step's weights")
            best = None
    _write_final(session, hooks, reason, best)
    loss_text = f"{hooks.last_loss:.4f}" if hooks.last_loss is not None else "-"
    what = "model" if session.full else "adapter"
    where = "smoke test passed" if session.smoke else f"{what} in {run_dir / 'final'}"
    if best is not None:
        where += f" (the best checkpoint, {best}: eval_loss {state.best_eval_loss:.4f})"
    if reason == "early_stop":
        training = recipe.training
        say(f"early stop: eval_loss did not improve by more than {training.early_stopping_min_delta} for "
            f"{training.early_stopping_patience} evaluations; best {state.best_eval_loss:.4f} at step {state.best_step}")
    say(f"done: {state.step} steps in {state.elapsed_s:.1f} s; final loss {loss_text}; {where}")
    if state.nonfinite_steps:
        say(_nonfinite_warning(state, recipe))
    _all_finished(session, hooks)
    return RunResult(run_dir, reason, hooks.last_loss, state.step)


def _write_final(session: Session, hooks: RunHooks, reason: str, best: str | None) -> None:
    """final/: the last step's weights (gathered under FSDP), or a copy of the best checkpoint's weights. A failure
    (a full disk) is every process's: all exit with the same error."""
    from gpupoor.storage.checkpoint import CheckpointError, write_checkpoint

    state, final = session.state, session.run_dir / "final"
    manifest = {**hooks.manifest_base, "loss": hooks.last_loss, "stop": reason}
    if best is not None:
        save = functools.partial(_copy_weights, session.checkpoints_dir / best)
        step, manifest = state.best_step, {**manifest, "from_checkpoint": best, "eval_loss": state.best_eval_loss}
    else:
        gathered = session.gather_weights()  # collective under FSDP
        save, step = functools.partial(session.save_weights, gathered=gathered), state.step
    error = None
    if session.main:
        try:
            write_checkpoint(final, save, step, manifest, session.saved_weight_bytes())
        except (CheckpointError, OSError) as exc:  # the others must learn of it, or they would wait for it forever
            error = exc
    if hooks._anywhere(error is not None):
        raise hooks._failed(final, error)


def _copy_weights(checkpoint: Path, tmp: Path) -> None:
    """A checkpoint's weights, config and tokenizer files, without what only training reads back."""
    from gpupoor.storage.checkpoint import MANIFEST, TRAINING_FILES
    from gpupoor.train.distributed import DCP_OPTIMIZER

    skip = {MANIFEST, "scaler.pt", *TRAINING_FILES}
    for path in checkpoint.rglob("*"):
        relative = path.relative_to(checkpoint)
        if path.is_file() and str(relative) not in skip and relative.parts[0] != DCP_OPTIMIZER:
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, tmp / relative)


def _all_finished(session: Session, hooks: RunHooks) -> None:
    """No process exits before every process has finished its part: torchrun stops the others as soon as one
    exits with a non-zero code (75 after a stop), which would cut the first process's bookkeeping short."""
    session.accelerator.wait_for_everyone()
    hooks.stop.finished = True
    # Then the process group goes, while the interpreter is whole: left to interpreter shutdown, gloo's worker
    # threads can still hold tensors whose release needs the GIL, and the process aborts (SIGABRT, "terminate
    # called without an active exception") after a run that succeeded. Only here, on the paths every process
    # reaches: destroying it while another process is mid-collective (after an error) would hang instead.
    session.accelerator.end_training()
