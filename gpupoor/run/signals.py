"""Preemption: SIGTERM, SIGINT, SIGUSR1 and SIGHUP (a closed terminal or dropped ssh session) ask for a checkpoint
and a clean stop at the next optimizer step boundary; a signal this process was started ignoring (`nohup` ignores
SIGHUP) stays ignored. A second signal during the save is noted and ignored (the save completes); a third aborts at once,
leaving the last committed checkpoint valid (the commit protocol guarantees it)."""

from __future__ import annotations

import os
import signal
import sys

from gpupoor.errors import leave_hung_up_terminal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
EXIT_ABORTED = 130


class StopRequest:
    def __init__(self):
        self.count = 0
        self.name: str | None = None
        # Set once this process's part of the run is over (several processes: after the last barrier). A
        # launcher stops the other processes when the first one exits; those finish exiting, with their own
        # exit code, instead of reporting a checkpoint that is already written.
        self.finished = False
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.count > 0

    def _handle(self, signum, frame) -> None:
        if self.finished:
            return
        self.count += 1
        self.name = self.name or signal.Signals(signum).name
        leave_hung_up_terminal(signum)  # (a closed terminal: its EIO would end the run with exit 1, unsaved)
        if self.count == 1:
            print(f"\n{self.name}: saving a checkpoint at the end of this step, then stopping "
                  "(send again twice to abort at once)", file=sys.stderr, flush=True)
        elif self.count == 2:
            print("still saving; one more signal aborts (the last committed checkpoint stays valid)",
                  file=sys.stderr, flush=True)
        else:
            print("aborting", file=sys.stderr, flush=True)
            os._exit(EXIT_ABORTED)

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:  # nohup's SIGHUP: the user asked that it not stop the run
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def ignore_from_now(self) -> None:
        """Ignore stop signals until this process exits. SIG_IGN, not a Python handler: Python puts the default
        action (death) back for its own handlers as the interpreter shuts down."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
