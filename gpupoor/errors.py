"""Errors meant for people. Anything raised as a UserError exits with code 2 and no traceback. And Terminated:
SIGTERM or SIGHUP as an exception, for every verb with nothing to checkpoint (gpupoor.outcome.guarded raises them
around each command), so that their `with` blocks and temporary folders remove what they half wrote, as they do
for Ctrl-C (train and resume checkpoint instead: gpupoor/run/signals.py)."""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_FAILED = 1  # a run that cannot go on (RunFailed), or any other error
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3  # gpupoor plan: the recipe is predicted not to fit the memory
EXIT_RESUMABLE = 75  # stopped early on purpose (signal, time limit); `gpupoor resume` continues
EXIT_INTERRUPTED = 130  # Ctrl-C (the shell's code for SIGINT)


class UserError(Exception):
    """Bad input: a recipe, a data file, a run directory. The message says what, where and what to do."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class RunFailed(Exception):
    """Training cannot go on (diverged, disk full); the last committed checkpoint is intact. Exit 1."""


TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is. A KeyboardInterrupt, so that what cleans up after Ctrl-C
    (and the command line's handling of it) cleans up after these too; `exit_code` is the shell's code for death
    by that signal (143, 129), which a scheduler or script reads the same as before."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def leave_hung_up_terminal(signum: int) -> None:
    """After SIGHUP from a terminal that closed (a dropped ssh session), every write to it fails with EIO: the
    process's last lines (a checkpoint saved, `stopped by SIGHUP`) would raise OSError and end it with exit 1
    instead. Standard output and error that are that terminal go to /dev/null from now on, as `nohup` would have
    sent them; a pipe or file is left as it is."""
    import os

    if signum != signal.SIGHUP:
        return
    for fd in (1, 2):
        try:
            if os.isatty(fd) or _hung_up(fd):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
        except OSError:
            pass


def _hung_up(fd: int) -> bool:
    """A terminal whose other end is gone (isatty may still say so, or may not once it is hung up)."""
    import os
    import stat

    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            return False
        os.write(fd, b"")
        return False
    except OSError:
        return True


class _RaiseOnce:
    """The handler: the first signal raises; later ones are ignored, so a repeated SIGTERM cannot cut short the
    cleanup the first one started (removing a scratch model of tens of GB takes a moment)."""

    def __init__(self):
        self.raised = False

    def __call__(self, signum, frame) -> None:
        if not self.raised:
            self.raised = True
            leave_hung_up_terminal(signum)
            raise Terminated(signum)


@contextlib.contextmanager
def termination_raised():
    """SIGTERM and SIGHUP raise Terminated inside the block (the handlers before it are put back after). Nested
    blocks share the outer one's handler. Only the main thread can install handlers: elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread() or \
            isinstance(signal.getsignal(signal.SIGTERM), _RaiseOnce):
        yield
        return
    handler = _RaiseOnce()
    # (a signal the process was started ignoring stays ignored: `nohup gpupoor export ...` outlives its terminal)
    previous = {sig: signal.signal(sig, handler) for sig in TERMINATING if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, before in previous.items():
            if signal.getsignal(sig) is handler:  # one set inside the block (train's SIG_IGN while it exits) stays
                signal.signal(sig, signal.SIG_DFL if before is None else before)  # None: a handler set from C
