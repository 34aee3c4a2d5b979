"""Orchestration of `gpupoor train` and `gpupoor resume`: the one place that knows every part.

One run is a few stages, each in its module of gpupoor.run, in the order they happen:

    build_session   recipe -> hardware choices, tokenizer, data, model, optimizer      session.py (builders)
    restore         a checkpoint's tensors and progress into what was built           restore.py
    choose_loss     the training loss and the eval sums                               gpupoor.objectives.choose
    print_summary   what was chosen and why                                           summary.py
    open_run_dir    lock it, store the recipe, trim metrics redone after a checkpoint directory.py
    train           the loop with RunHooks: Reporter, EvalJudge, CheckpointSaver      hooks.py (and saving.py)
    finish          the final adapter, or why it stopped and how to continue          finish.py

Where new things go: a training method is built in gpupoor.model.methods (its rules in decisions.py); a tracker is
a writer beside MetricsWriter, called from Reporter.write; a distributed strategy is chosen in
session.make_accelerator (its rules in decisions.py); a data source or mixture lands in gpupoor/data.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from gpupoor.errors import RunFailed, UserError
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.recipe.schema import Recipe
from gpupoor.run.session import SMOKE_FP16, RunResult, Session, check_launch, smoke_recipe
from gpupoor.storage.rundir import (RunLock, check_run_dir, check_writable, end_session, portable_recipe,
                                    resolve_run_dir, stored_recipe)

# ----------------------------------------------------------------------------------------------------------
# Entry points


def train_from_recipe(loaded: LoadedRecipe, output_dir: str | None = None, *, smoke: bool = False,
                      say=print, started: float | None = None, plan=None, stop=None) -> RunResult:
    """A new run. `started`: time.monotonic() when the command began; the time limit counts from there.
    `plan`: the memory plan the preflight made (made here when not given). `stop`: the command's StopRequest."""
    started = time.monotonic() if started is None else started
    recipe = portable_recipe(loaded)
    if smoke:
        if recipe.precision == "fp16":
            say(f"note: {SMOKE_FP16}")
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
            return _execute(recipe, run_dir, None, smoke=smoke, say=say, started=started, plan=plan, stop=stop)
    finally:
        if temporary:
            shutil.rmtree(run_dir, ignore_errors=True)


def resume_run(run_dir: Path, overrides: list[str], *, force: bool = False, say=print,
               started: float | None = None, stop=None, recipe: LoadedRecipe | None = None,
               invocation: list[str] | None = None) -> RunResult:
    """Continue a run from its newest valid checkpoint (or say it is already done). `recipe`: a recipe file to
    resume with instead of the stored one plus `overrides` (train --resume-if-present); its differences from
    the stored recipe are judged like --set changes. `invocation`: overrides for this invocation only (resume's
    --time-limit and --profile), applied after `overrides` and not stored with the run."""
    invocation = invocation or []
    from gpupoor.storage.rundir import require_run_dir

    started = time.monotonic() if started is None else started
    run_dir = run_dir.expanduser().resolve()
    require_run_dir(run_dir)
    check_launch()
    if not _first_process():  # one process (the first) holds the lock and speaks for the others
        with _stop_requests(stop) as stop:
            return _resume_locked(run_dir, overrides, force=force, say=lambda *args, **kwargs: None,
                                  started=started, lock=None, stop=stop, replacement=recipe, invocation=invocation)
    lock = RunLock(run_dir).acquire()
    try:
        with _stop_requests(stop) as stop:
            return _resume_locked(run_dir, overrides, force=force, say=say, started=started, lock=lock, stop=stop,
                                  replacement=recipe, invocation=invocation)
    finally:
        lock.release()


def _first_process() -> bool:
    """True in the process of rank 0 (or the only one), before accelerate is set up: launchers export RANK."""
    return int(os.environ.get("RANK", "0")) == 0


def _resume_locked(run_dir: Path, overrides: list[str], *, force: bool, say, started: float, lock, stop,
                   replacement: LoadedRecipe | None = None, invocation: list[str] = ()) -> RunResult:
    from gpupoor.storage.checkpoint import final_problem, latest_valid, sweep_temporary
    from gpupoor.recipe.diff import diff_recipes, format_changes

    stored = stored_recipe(run_dir)
    # Paths given with --set resolve against the current directory and are stored absolute, like train's.
    recipe = portable_recipe(replacement or LoadedRecipe(stored_recipe(run_dir, [*overrides, *invocation]), None))
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
    # --time-limit and --profile are this invocation's: the stored recipe keeps the run's own for later resumes.
    to_store = portable_recipe(LoadedRecipe(stored_recipe(run_dir, overrides), None)) \
        if invocation and replacement is None else None
    return _execute(recipe, run_dir, checkpoint, smoke=False, say=say, started=started, force=force, lock=lock,
                    plan=plan, stop=stop, recipe_to_store=to_store)


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


def _plan_quietly(loaded: LoadedRecipe, device: str | None = None, timing: dict | None = None):
    """The memory plan for the startup summary (one of the processes launched), or None when the model is not
    one it can describe. `timing`: with the time plan too (gpupoor.plan.time.assemble.time_plan's options)."""
    from gpupoor.decisions import launch_layout
    from gpupoor.plan.make import make_plan

    try:
        processes, nodes = launch_layout(os.environ)
        return make_plan(loaded, device, processes=processes, nodes=nodes, timing=timing)
    except Exception:  # advisory: never let the plan stop a run
        return None


def _train_timing(session, say, stop) -> dict | None:
    """The time plan's options in training: this run's threads; what the facts cache lacks measured now by the
    first process (`gpupoor plan` would have measured the same), unless GPUPOOR_TIME_PLAN=cached says to use
    only the cache. None inside the plan's own step probe (a probe plans nothing)."""
    from gpupoor.plan.time.assemble import time_plan_mode

    if os.environ.get("GPUPOOR_STEP_PROBE"):
        return None
    threads = session.choices.get("threads")
    startup = session.startup.seconds() if session.startup is not None else {}
    cached_only = time_plan_mode() == "cached" or not session.main
    return {"threads": int(threads.value) if threads is not None else None, "gpu": None,
            "time_limit_s": session.recipe.checkpoint.time_limit_s, "say": say, "cached_only": cached_only,
            "cli_s": startup.get("python and cli"), "stop": (lambda: stop.requested) if stop is not None else None}


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



# ----------------------------------------------------------------------------------------------------------
# The run


def _execute(recipe: Recipe, run_dir: Path, checkpoint, *, smoke: bool, say, started: float,
             force: bool = False, lock: RunLock | None = None, plan=None, stop=None,
             recipe_to_store: Recipe | None = None) -> RunResult:
    """Setup (build, check, restore, summary, run directory), train, then finish (or clean up after a failure)."""
    from gpupoor.run.startup import StartupClock

    clock = StartupClock()  # before the imports below: torch is among them
    from gpupoor.run.directory import open_run_dir
    from gpupoor.run.finish import finish
    from gpupoor.run.hooks import RunHooks
    from gpupoor.run.restore import check_checkpoint_matches, check_models, restore
    from gpupoor.run.session import build_session
    from gpupoor.run.summary import print_summary
    from gpupoor.train.state import restore_rng

    session = build_session(recipe, run_dir, smoke=smoke, say=say, resuming=checkpoint is not None, clock=clock,
                            trained_in=checkpoint.manifest if checkpoint is not None else None)
    session.recipe_to_store = recipe_to_store
    if not session.main:
        say = lambda *args, **kwargs: None  # noqa: E731 -- one process reports
    if checkpoint is not None and not force:
        check_checkpoint_matches(session, checkpoint)
    elif checkpoint is not None and checkpoint.manifest.get("processes", 1) != session.accelerator.num_processes:
        say(f"warning: --force: processes {checkpoint.manifest.get('processes', 1)} -> "
            f"{session.accelerator.num_processes}: resuming on another layout (the optimizer state is resharded)")
    models, model_changes = check_models(session, checkpoint, force=force, say=say)
    restore(session, checkpoint, force=force)
    if checkpoint is not None:
        session.startup.mark("restore")
    loss = _choose_loss(session)
    # Planned for another device than torch found, or another precision than training chose (the CPU's matmul
    # probe, a resume keeping its checkpoint's): planned again for what was built.
    chosen = session.choices["precision"].value
    if plan is not None and (plan.device, plan.precision) != (session.device, chosen):
        plan = _plan_quietly(LoadedRecipe(recipe.model_copy(update={"precision": chosen}), None), session.device)
    timing = _train_timing(session, say, stop) if plan is not None else None
    if timing is not None:  # the time plan from the facts cache, what it lacks measured now (and cached)
        plan = _plan_quietly(LoadedRecipe(recipe.model_copy(update={"precision": chosen}), None), session.device,
                             timing=timing) or plan
        if session.startup is not None and not timing["cached_only"]:
            session.startup.mark("time plan")
    session.memory_plan = plan
    print_summary(session, say=say, checkpoint=checkpoint, loss_path=loss.name)
    owned_lock = open_run_dir(session, lock=lock, started=started, say=say)
    hooks = RunHooks(session, policy=_checkpoint_policy(session, started), stop=stop,
                     manifest_base=_manifest_base(session, models), resumed=checkpoint is not None)
    for key, change in model_changes.items():  # accepted with --force: the next checkpoint records the new one
        hooks.report.write({"step": session.state.step, "event": "model_changed", "key": key, "change": change})
    if checkpoint is not None:
        # Last, so nothing above consumes the restored stream; each process its own when the checkpoint has them.
        by_rank, accelerator = session.state.rng_by_rank, session.accelerator
        restore_rng(by_rank[accelerator.process_index] if len(by_rank) == accelerator.num_processes
                    else session.state.rng)
        rollouts = session.state.rollout_by_rank  # GRPO's answers kept for the next iterations: this process's own
        if len(rollouts) == accelerator.num_processes:
            session.state.rollout = rollouts[accelerator.process_index]
    try:
        reason, name = _train(session, hooks, loss)
    finally:
        hooks.close()
        if session.main:
            end_session(run_dir)
        if owned_lock is not None:
            owned_lock.release()
    return finish(session, hooks, reason=reason, name=name, started=started, say=say)


def _choose_loss(session: Session):
    """The recipe's loss for the built models (gpupoor.objectives.choose); fault injection (GPUPOOR_FAULT=nan@STEP)
    may make chosen steps non-finite."""
    from gpupoor import faults
    from gpupoor.objectives.choose import choose_loss

    chosen = choose_loss(session.recipe, session.unwrapped, device=session.device, teacher=session.teacher,
                         reference=session.reference, tokenizer=session.tokenizer, state_of=lambda: session.state,
                         rank=session.accelerator.process_index, processes=session.accelerator.num_processes)
    base_loss = chosen.loss_fn
    session.samples_from = base_loss if hasattr(base_loss, "samples") else None  # GRPO: its sampled answers
    if hasattr(base_loss, "after_sampling"):
        from gpupoor.train.heap import heap_trimmer

        trimmer = heap_trimmer(str(session.device).split(":")[0])
        base_loss.after_sampling = trimmer.after_backward if trimmer is not None else None
    nan_steps = faults.steps_for("nan")
    if not nan_steps:
        return chosen

    def loss_with_faults(model, batch):
        loss = base_loss(model, batch)
        if session.state.step + 1 not in nan_steps:
            return loss
        return (loss[0] * float("nan"), *loss[1:]) if isinstance(loss, tuple) else loss * float("nan")

    return chosen.with_loss(loss_with_faults)


def _checkpoint_policy(session: Session, started: float):
    """When to save, with the first checkpoint's size until one is measured: the saved weights (the whole model
    for `full`) plus the optimizer's two moments of what trains."""
    from gpupoor.run.saving import CheckpointPolicy

    checkpoint = session.recipe.checkpoint
    trainable_bytes = sum(p.numel() * p.element_size() for p in session.unwrapped.parameters() if p.requires_grad)
    return CheckpointPolicy(every_steps=checkpoint.every_steps, interval_minutes=checkpoint.interval_minutes,
                            time_limit_s=checkpoint.time_limit_s, started=started,
                            expected_bytes=session.saved_weight_bytes() + 2 * trainable_bytes + 2**20,
                            last_step=session.state.step)


def _manifest_base(session: Session, models: dict) -> dict:
    """What every checkpoint's (and final/'s) manifest records about the run that wrote it."""
    from gpupoor.recipe.diff import trajectory_hash
    from gpupoor.storage.rundir import library_versions

    return {"recipe_hash": trajectory_hash(session.recipe), "data_fingerprint": session.data.fingerprint,
            "weights": "model" if session.full else "adapter", "optimizer": "dcp" if session.sharded else "torch",
            "processes": session.accelerator.num_processes, "strategy": session.choices["strategy"].value,
            "total_steps": session.steps, "warmup_steps": session.warmup,
            "precision": session.choices["precision"].value, "device": session.device,
            "versions": library_versions(), "models": models}


def _train(session: Session, hooks, loss) -> tuple[str, str]:
    """Run the loop; always end on a committed checkpoint of the last step. Returns (why it stopped, its name)."""
    from gpupoor.run.session import loop_settings
    from gpupoor.train.distributed import any_process
    from gpupoor.train.loop import TooManySkippedSteps, train

    report, saver = hooks.report, hooks.saver
    try:
        with _profiler(session, report) as report.profiler:
            reason = train(session.model, session.optimizer, session.scheduler, session.accelerator, session.data,
                           session.state, loop_settings(session, loss), hooks.loop_hooks())
    except TooManySkippedSteps as exc:
        raise RunFailed(f"{exc}. The last good checkpoint is kept; lower training.learning_rate or check the "
                        f"data, then continue with: gpupoor resume {session.run_dir}") from None
    finally:
        report.progress.close()
    step = session.state.step
    name = f"step-{step:06d}"
    # Also at the end, so `resume --set training.max_steps=N` can extend; decided by all (the save is collective).
    if any_process(saver.policy.last_step != step or not (session.checkpoints_dir / name).is_dir()):
        name = saver.save()
    state = session.state
    if reason == "early_stop":
        report.write({"step": step, "event": "early_stop", "best_step": state.best_step,
                      "best_eval_loss": state.best_eval_loss})
    elif reason != "done":
        report.write({"step": step, "event": "stop", "reason": reason})
    report.write({"step": step, "event": "end", "reason": reason, "skipped_steps": state.skipped_steps,
                  "nonfinite_steps": state.nonfinite_steps})
    return reason, name


def _profiler(session: Session, report):
    """logging.profile_steps: a StepProfiler around the loop (Reporter.step advances it), else nothing."""
    steps = session.recipe.logging.profile_steps
    if not steps:
        return contextlib.nullcontext()
    from gpupoor.profiling import StepProfiler

    return StepProfiler(steps, session.run_dir / "profile", session.device, session.accelerator.process_index,
                        session.main, lambda text: report.message(text, always=True))
