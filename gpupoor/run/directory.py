"""The run directory at the start of a session: a new run's is created and locked (a resume holds its lock
already), then, with everything built and loaded, the recipe is committed, metrics the resumed steps will write
again are trimmed and the session is recorded."""

from __future__ import annotations

from gpupoor.run.session import Session, loop_settings
from gpupoor.storage.rundir import RunLock, check_run_dir, holds_something, store_recipe, write_session


def open_run_dir(session: Session, *, lock: RunLock | None, started: float,
                 say=print) -> RunLock | None:
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
        store_recipe(session.run_dir, session.recipe_to_store or session.recipe)
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
