"""`gpupoor train` and `gpupoor resume` around the orchestrator (gpupoor.run.orchestrate, called from `train` and
`resume` here): the recipe overrides their options stand for, the checks before a run starts, the run that
--resume-if-present continues, the command line of each process torchrun's launcher starts, and how one process of
several ends. Imports no torch until a run starts."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from gpupoor.errors import EXIT_RESUMABLE, UserError

FINISHED = ("done", "already_done", "early_stop")  # exit 0; any other reason stopped with a checkpoint: exit 75


def exit_code(reason: str) -> int:
    """0 for a run that finished, 75 (resumable) for one that stopped with a checkpoint."""
    return 0 if reason in FINISHED else EXIT_RESUMABLE


def recipe_overrides(set_: list[str] | None, time_limit: str | None, profile: int | None) -> list[str]:
    """--set, --time-limit and --profile as the recipe overrides they stand for, in that order."""
    profile_steps = [] if profile is None else [f"logging.profile_steps={profile}"]
    return (set_ or []) + _time_limit_override(time_limit) + profile_steps


def _time_limit_override(time_limit: str | None) -> list[str]:
    """--time-limit as the checkpoint.time_limit override, checked here so an error names the option."""
    if time_limit is None:
        return []
    from gpupoor.units import parse_duration

    try:
        seconds = parse_duration(time_limit)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise UserError(f"--time-limit {time_limit!r}: not a positive duration; use e.g. 11h30m, 45m or 90s")
    return [f"checkpoint.time_limit={json.dumps(time_limit)}"]  # a JSON string is a quoted YAML scalar


def existing_run(loaded, output_dir: str | None) -> Path | None:
    """The run directory train would write into, when a run is already there."""
    from gpupoor.storage.rundir import is_run_dir, resolve_run_dir

    run_dir = resolve_run_dir(loaded, output_dir, loaded.source.stem if loaded.source else "run")
    return run_dir if is_run_dir(run_dir) else None


def check_before_training(loaded, smoke: bool, force: bool, warn: Callable[[str], None]):
    """validate's checks (their warnings said), then the memory plan: refuses a recipe predicted not to fit
    unless `force`. Returns the plan; None for a smoke test (a shrunken model on the CPU: the full-size plan
    does not apply)."""
    from gpupoor.commands.validate import preflight

    for warning in preflight(loaded):
        warn(warning)
    if smoke:
        return None
    from gpupoor.plan.make import preflight_plan

    return preflight_plan(loaded, force, warn)


def train(recipe: Path, overrides: list[str], output_dir: str | None, *, smoke: bool, force: bool,
          resume_if_present: bool, started: float, stop, warn: Callable[[str], None]) -> int:
    """`gpupoor train`: the recipe loaded with its overrides (recipe_overrides), then either the run already in
    the output directory resumed (--resume-if-present) or the checks before training and a new run. `started`:
    when the command started (a time limit counts from there); `stop`: its stop requests. Returns the exit code."""
    from gpupoor.plan.time.assemble import check_environment
    from gpupoor.recipe.loading import load_recipe

    check_environment()
    loaded = load_recipe(recipe, overrides)
    existing = existing_run(loaded, output_dir) if resume_if_present and not smoke else None
    if existing is not None:
        from gpupoor.run.orchestrate import resume_run

        return exit_code(report_finished(resume_run(existing, [], started=started, stop=stop, recipe=loaded)))
    plan = check_before_training(loaded, smoke, force, warn)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from gpupoor.run.orchestrate import train_from_recipe

    return exit_code(report_finished(train_from_recipe(loaded, output_dir, smoke=smoke, started=started, plan=plan,
                                                       stop=stop)))


def resume(run_dir: Path, set_: list[str] | None, *, force: bool, time_limit: str | None, profile: int | None,
           started: float, stop) -> int:
    """`gpupoor resume`: the run continued from its newest valid checkpoint. --set changes are the run's from now
    on; --time-limit and --profile this invocation's only. Returns the exit code."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from gpupoor.plan.time.assemble import check_environment
    from gpupoor.run.orchestrate import resume_run

    check_environment()
    return exit_code(report_finished(resume_run(run_dir, recipe_overrides(set_, None, None), force=force,
                                                started=started, stop=stop,
                                                invocation=recipe_overrides(None, time_limit, profile))))


def launch_processes(context, launch_params: tuple[str, ...], debug: bool, say: Callable[[str], None]) -> int:
    """Run this command (typer's `context`) in the processes torchrun's launcher starts, each with the same
    command line less the launch options (`launch_params`, torchrun_args's in its order); their exit code
    (gpupoor.run.launch)."""
    from gpupoor.run.launch import check_process_count, launch, torchrun_args

    check_process_count(context.params["nproc_per_node"])
    command = [context.info_name]
    for param in context.command.params:
        value = context.params.get(param.name)
        if param.name in launch_params or value is None or value is False:
            continue
        if param.param_type_name == "argument":
            command.append(str(value))
        elif param.is_flag:
            command.append(param.opts[0])
        else:
            command += [item for v in (value if param.multiple else [value]) for item in (param.opts[0], str(v))]
    return launch(torchrun_args(*(context.params[name] for name in launch_params)), command, debug, say=say)


def leave_now(code: int) -> None:
    """End one process of several once its part is over (after the last barrier; metrics, trackers and files
    closed), without the interpreter's teardown. gloo's threads and sockets outlive destroy_process_group (its
    backend has no shutdown of its own, and the group lives on while anything refers to it), so they were torn
    down with the interpreter, and now and then that aborted a process that had trained fine (SIGABRT; on two
    nodes the other node's torchrun then waited 300 s for it at its exit barrier)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_finished(result, say=print) -> str:
    """A run that finished writes RUN_DIR/report.html by itself (`gpupoor report`'s page), unless logging.report
    is off or matplotlib (the `report` extra) is missing; a failure to draw is a warning, never the run's. One
    process of a launch draws. Returns the result's reason, for exit_code."""
    import importlib.util
    import os

    from gpupoor.storage.rundir import is_run_dir, stored_recipe

    if result.reason not in ("done", "early_stop") or os.environ.get("RANK", "0") != "0" \
            or not is_run_dir(result.run_dir) or importlib.util.find_spec("matplotlib") is None:
        return result.reason  # (a smoke test's temporary run directory is gone by now)
    if not stored_recipe(result.run_dir).logging.report:
        return result.reason
    try:
        from gpupoor.commands.report import write_report

        say(f"report: {write_report([result.run_dir], result.run_dir / 'report.html', False)}")
    except Exception as exc:  # drawing must never fail a finished run
        say(f"warning: the report was not written ({type(exc).__name__}: {exc}); gpupoor report {result.run_dir} "
            "tries again")
    return result.reason
