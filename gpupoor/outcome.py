"""How a command ends, the same for every verb (gpupoor/cli.py runs each through `guarded`): bad input exits 2
with its message and no traceback, a failed run or any other error exits 1 (the traceback with --debug), Ctrl-C
130 and SIGTERM/SIGHUP where a verb raises them 143/129, a file-system error names its path and what to do (2
when the path cannot be used as named, 1 when the disk is full). `with_stop_requests` is train's and resume's
policy on top: a stop signal from their first line to their last ends in a checkpoint and exit 75."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from gpupoor.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, RunFailed, UserError, termination_raised
from gpupoor.run.startup import from_command_line


def with_stop_requests(action: Callable[..., int | None]) -> Callable[[], int | None]:
    """Train and resume note SIGTERM/SIGINT/SIGUSR1 from their first line to their last, so a signal during
    start-up or after the stop checkpoint still ends in a checkpoint and exit 75, never a bare 143."""

    def guarded() -> int | None:
        from gpupoor.commands.train import leave_now
        from gpupoor.run.launch import report_once
        from gpupoor.run.signals import StopRequest

        several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # this process is one of several a launcher started
        stop = StopRequest().install()
        refused = False
        try:
            code = action(stop)
        except UserError as exc:
            if not (from_command_line() and several) or "--debug" in sys.argv:
                raise
            # Bad input every process agreed on (a base changed since the checkpoint, say): said, then ended
            # without the interpreter's teardown of gloo, which now and then aborted such a process with SIGABRT
            # (see commands.train.leave_now) and the launcher reported "killed by SIGABRT" instead of exit 2.
            # Said once for all the processes, by gpupoor's launcher where it started them.
            report_once(str(exc), say=lambda text: typer.echo(f"error: {text}", err=True))
            code, refused = EXIT_BAD_INPUT, True
        except RunFailed as exc:
            if not (stop.finished and from_command_line() and several):
                raise
            # A failure every process agreed on (a full disk during a save): said, then ended like a finished
            # process, without the interpreter's teardown of gloo (see commands.train.leave_now).
            report_once(str(exc), say=lambda text: typer.echo(f"error: {text}", err=True))
            code = EXIT_FAILED
        finally:
            # The outcome is decided (a checkpoint or final/ committed, or the error said): a signal while the process
            # exits must not turn it into a bare 143 -- the launcher's SIGTERM to a finished process, or a scheduler's
            # second one during interpreter shutdown (torch's teardown takes a while).
            if from_command_line() or (stop.finished and several):
                stop.ignore_from_now()
            else:
                stop.uninstall()  # a program or test calling the command keeps its own handlers
        from gpupoor import faults

        faults.at_stage("exiting")  # tests: a scheduler's signal once the outcome is decided
        if refused or (stop.finished and from_command_line() and several):
            leave_now(code or 0)
        return code

    return guarded


def guarded(debug: bool, action: Callable[[], int | None]) -> None:
    """Run a command: bad input exits 2 with a message, other failures exit 1, tracebacks only with --debug.
    SIGTERM and SIGHUP unwind it as Ctrl-C does (what it half wrote removed on the way out), exit 143 / 129."""
    try:
        with termination_raised():
            code = action() or 0
    except UserError as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except KeyboardInterrupt as exc:  # Ctrl-C (130), or SIGTERM / SIGHUP where a verb turns them into one (143, 129)
        typer.echo(f"stopped by {exc.name}" if hasattr(exc, "signum") else "interrupted", err=True)
        raise typer.Exit(getattr(exc, "exit_code", EXIT_INTERRUPTED)) from None
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, RunFailed):
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_FAILED) from None
        if isinstance(exc, OSError) and exc.errno is not None:
            message, code = file_system_error(exc)
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(code) from None
        typer.echo(f"error: {type(exc).__name__}: {exc}\n  (run again with --debug for the traceback)", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    raise typer.Exit(code)


# A path that cannot be used as named is bad input (exit 2); a full disk or quota, an I/O error, is the
# environment's (exit 1). Either way: the path, what the system said, what to do.
_PATH_ERRNOS = {errno.EACCES: "this user may not use that path as the command needs (read, write or enter it): "
                "choose one you can, or fix its permissions", errno.EPERM: "the operation is not permitted on that "
                "path for this user: choose another location, or fix its permissions",
                errno.EROFS: "the file system is read-only: choose a location on a writable one"}
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def file_system_error(exc: OSError) -> tuple[str, int]:
    """The one-line message and exit code for an OSError that reached the command: its path, its meaning, what
    to do."""
    from gpupoor.storage.files import blocking_file

    path = Path(exc.filename) if exc.filename else None
    where = f"{path}: " if path else ""
    what = f"{where}{exc.strerror} (errno {errno.errorcode.get(exc.errno, exc.errno)})"
    if exc.errno in _FULL_ERRNOS:
        folder = next((parent for parent in path.parents if parent.is_dir()), Path.cwd()) if path else Path.cwd()
        return (f"{what}\n  hint: free space on that file system (df -h {folder}) or write somewhere else, then "
                "run the command again"), EXIT_FAILED
    if exc.errno in _PATH_ERRNOS:
        return f"{what}\n  hint: {_PATH_ERRNOS[exc.errno]}", EXIT_BAD_INPUT
    blocker = blocking_file(path) if path is not None and exc.errno in (errno.EEXIST, errno.ENOTDIR) else None
    if blocker is not None:
        where = "" if blocker == path else where
        return (f"{where}{blocker} is a file, not a directory\n  hint: remove or rename it, or choose another "
                "location"), EXIT_BAD_INPUT
    return f"{what}\n  (run again with --debug for the traceback)", EXIT_FAILED
