"""The end of a session: final/ (the last step's weights, or a copy of the best checkpoint's) and the closing
lines, or why the run stopped early and how to continue it; then every process waits for the others before any
exits, so a launcher never cuts the first process's bookkeeping short."""

from __future__ import annotations

import functools
import shutil
import time
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.recipe.schema import Recipe
from gpupoor.run.reporting import nonfinite_advice
from gpupoor.run.session import RunResult, Session


def _nonfinite_warning(state, recipe: Recipe) -> str:
    """The end-of-session line when steps were skipped as non-finite: they did not update the weights."""
    return (f"warning: {state.nonfinite_steps} of {state.step} optimizer steps were skipped (a non-finite loss or "
            f"gradient norm; no update), so the run learned from {state.step - state.nonfinite_steps}. "
            + nonfinite_advice(recipe))


def finish(session: Session, hooks, *, reason: str, name: str, started: float, say) -> RunResult:
    """The final adapter, or why the run stopped early and how to continue it. `hooks`: the session's RunHooks
    (what it reported, its saver)."""
    from gpupoor import faults
    from gpupoor.run.saving import best_checkpoint
    from gpupoor.train.distributed import any_process

    recipe, run_dir, state, report = session.recipe, session.run_dir, session.state, hooks.report
    if reason not in ("done", "early_stop"):
        faults.at_stage("stopped")
        # (no limit in the recipe when the stop came from elsewhere, e.g. GPUPOOR_FAULT=timeout@STEP)
        limit = f" {recipe.checkpoint.time_limit}" if recipe.checkpoint.time_limit else ""
        if reason == "time_limit" and state.step == report.first_step:
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
        _all_finished(session, hooks.stop)
        return RunResult(run_dir, reason, report.last_loss, state.step)
    best = best_checkpoint(session) if recipe.checkpoint.final == "best" else None
    if best is not None:
        from gpupoor.storage.checkpoint import verify

        problem = verify(session.checkpoints_dir / best)  # it is copied, so it is checked first
        if any_process(problem is not None):
            say(f"warning: the best checkpoint {best} cannot become final/ ({problem or 'not found by every process'}"
                "): final/ holds the last step's weights")
            best = None
    _write_final(session, hooks.saver, reason=reason, best=best)
    loss_text = f"{report.last_loss:.4f}" if report.last_loss is not None else "-"
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
    _all_finished(session, hooks.stop)
    return RunResult(run_dir, reason, report.last_loss, state.step)


def _write_final(session: Session, saver, *, reason: str, best: str | None) -> None:
    """final/: the last step's weights (gathered under FSDP), or a copy of the best checkpoint's weights. A failure
    (a full disk) is every process's: all exit with the same error."""
    from gpupoor.storage.checkpoint import CheckpointError, write_checkpoint
    from gpupoor.train.distributed import any_process

    state, final = session.state, session.run_dir / "final"
    manifest = {**saver.manifest_base, "loss": saver.report.last_loss, "stop": reason}
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
    if any_process(error is not None):
        raise saver.failed(final, error)


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


def _all_finished(session: Session, stop) -> None:
    """No process exits before every process has finished its part: torchrun stops the others as soon as one
    exits with a non-zero code (75 after a stop), which would cut the first process's bookkeeping short."""
    session.accelerator.wait_for_everyone()
    stop.finished = True
    # Then the process group goes, while the interpreter is whole: left to interpreter shutdown, gloo's worker
    # threads can still hold tensors whose release needs the GIL, and the process aborts (SIGABRT, "terminate
    # called without an active exception") after a run that succeeded. Only here, on the paths every process
    # reaches: destroying it while another process is mid-collective (after an error) would hang instead.
    session.accelerator.end_training()
