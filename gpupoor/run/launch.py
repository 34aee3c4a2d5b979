"""`gpupoor train|resume --nproc-per-node N`: torchrun's own launcher (torch.distributed.run, in this process) with
gpupoor's exit codes. torchrun itself exits 1 with a ChildFailedError traceback whenever a process exits non-zero,
so a clean stop (every process 75, with its checkpoint) looked like a crash and a job script that requeues on 75
never requeued.

- Exit codes: every process of this node exited 75 -> 75; every one 0 -> 0; one of them 2 (bad input) -> 2; every
  one 130 (aborted) -> 130; anything else -> 1, with one line naming each process's exit code. (Each node's
  launcher judges its own processes; the processes agree on every stop, so all nodes say the same.)
- An error every process agreed on (bad input: exit 2; a full disk during a save: exit 1) is said once, by the
  launcher, above its summary line: each process leaves its message in a folder the launcher names in
  GPUPOOR_LAUNCH_ERRORS (report_once) instead of printing it, so N processes do not print it N times.
- SIGTERM, SIGINT and SIGUSR1 reaching the launcher are passed on to its processes (each started in a session of
  its own, so a terminal's Ctrl-C or a scheduler's signal to the launcher would not reach them) and the launcher
  waits for them: they save a checkpoint and exit 75. torchrun would instead stop them and kill them 30 s later.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpupoor.errors import EXIT_BAD_INPUT, EXIT_RESUMABLE, UserError
from gpupoor.run.signals import EXIT_ABORTED, STOP_SIGNALS
from gpupoor.run.startup import from_command_line

ERRORS_ENV = "GPUPOOR_LAUNCH_ERRORS"  # the folder a launched process leaves its error message in (report_once)
# The launcher's own shutdown handling stays on for these (the workers are stopped, as torchrun does).
LAUNCHER_SIGNALS = "SIGHUP,SIGQUIT"
LAUNCHER_SIGNAL_NUMBERS = (signal.SIGHUP, signal.SIGQUIT)  # left to torchrun's handler, not passed on by ours
# torchrun's --signals-to-handle, and exit codes read again after the processes are closed, came in torch 2.9.
LAUNCHER_TORCH = (2, 9)


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu'."""
    major, minor = (text.split("+")[0].split(".") + ["0", "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def torchrun_args(nproc_per_node: int, nnodes: str, node_rank: int, master_addr: str, master_port: int | None,
                  rdzv_endpoint: str | None) -> list[str]:
    """The torchrun command line for these options (the names are torchrun's; parsed by torchrun's own parser)."""
    # torchrun's launcher installs its handler for each of these without asking whether the signal was ignored: under
    # `nohup` it would take the SIGHUP of a closed terminal and stop every process
    handled = [name for name in LAUNCHER_SIGNALS.split(",")
               if signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN]
    args = ["--nproc-per-node", str(nproc_per_node), "--nnodes", nnodes, "--max-restarts", "0",
            "--signals-to-handle", ",".join(handled) or "SIGQUIT"]
    if rdzv_endpoint:  # c10d rendezvous: the nodes find each other at the endpoint (no node ranks)
        return [*args, "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    args += ["--node-rank", str(node_rank), "--master-addr", master_addr]
    return [*args, "--master-port", str(master_port)] if master_port is not None else args


def exit_code(codes: list[int]) -> int:
    """gpupoor's exit code for the exit codes of one node's processes."""
    if all(code == 0 for code in codes):
        return 0
    if all(code == EXIT_RESUMABLE for code in codes):
        return EXIT_RESUMABLE
    if EXIT_BAD_INPUT in codes:
        return EXIT_BAD_INPUT
    if all(code == EXIT_ABORTED for code in codes):
        return EXIT_ABORTED
    return 1


def report_once(text: str, say: Callable[[str], None]) -> None:
    """An error this process of a launch agreed on with the others: left for the launcher, which says each
    different message once (said here when this process has no launcher of gpupoor's, e.g. torchrun's own)."""
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        rank = os.environ.get("RANK", str(os.getpid()))
        try:
            staged = Path(folder) / f".rank-{rank}.txt"
            staged.write_text(text, encoding="utf-8")
            staged.rename(Path(folder) / f"rank-{rank}.txt")  # whole, or not there: the launcher may read any time
            return
        except OSError:
            pass  # (the launcher is gone, or its folder): said here instead
    say(text)


def _reported(folder: str) -> list[str]:
    """The different messages the processes left (report_once), by rank."""
    texts: list[str] = []
    files = sorted(Path(folder).glob("rank-*.txt"), key=lambda path: int(path.stem.removeprefix("rank-") or 0))
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text not in texts:
            texts.append(text)
    return texts


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _children() -> list[int]:
    """This process's child processes (the launched ones): /proc, since torch keeps their handles private."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == me:
                children.append(int(entry))
    return children


def _pass_on(signum, frame) -> None:
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _quiet_launcher() -> None:
    """torchrun's agent logs each stopped process as a failure ("failed (exitcode: 75)", "Sending process ...
    closing signal"); the launcher says what happened in one line instead (--debug keeps the agent's log)."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def check_process_count(nproc_per_node: int) -> None:
    """A UserError unless this machine has a device for each process: a GPU each, or on the CPU a core each (more
    processes than cores only take turns on them; a mistyped 40 or 4000000 started that many, and the launcher's
    bookkeeping alone ran the machine out of memory)."""
    import torch

    from gpupoor.hardware import usable_cpu_count

    have, what = (torch.cuda.device_count(), "CUDA GPUs") if torch.cuda.is_available() else \
        (usable_cpu_count(), "CPU cores for this process")
    if nproc_per_node > have:
        raise UserError(f"--nproc-per-node {nproc_per_node}: this machine has {have} {what}, one for each process",
                        hint=f"give at most {have} (processes on other machines: --nnodes with the same command "
                        "there)")


def launch(torchrun: list[str], command: list[str], debug: bool = False, say=print) -> int:
    """Run `python -m gpupoor COMMAND` in the processes torchrun's options `torchrun` ask for; return the exit
    code for all of them (see the module docstring)."""
    if "WORLD_SIZE" in os.environ:
        raise UserError("--nproc-per-node starts the processes itself, but this process is one of several "
                        "already (WORLD_SIZE is set: a launcher such as torchrun started it)",
                        hint="drop --nproc-per-node and the other launch options, or run gpupoor without torchrun")
    import torch

    if _version(torch.__version__) < LAUNCHER_TORCH:
        raise UserError(f"--nproc-per-node needs torch {'.'.join(map(str, LAUNCHER_TORCH))} or newer (this is "
                        f"{torch.__version__}): older launchers cannot hand their signals on or report each "
                        "process's exit code", hint="upgrade torch, or launch with torchrun (which exits 1 when "
                        "the processes stop with 75: requeue on the run's checkpoint, not the exit code)")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args([*torchrun, "-m", "gpupoor", *command])
    if not debug:
        _quiet_launcher()
    previous = {sig: signal.signal(sig, _pass_on) for sig in STOP_SIGNALS if sig not in LAUNCHER_SIGNAL_NUMBERS}
    errors = tempfile.TemporaryDirectory(prefix="gpupoor-launch-")
    os.environ[ERRORS_ENV] = errors.name  # the processes inherit this process's environment
    try:
        run(args)  # torchrun's own entry point after parsing; returns when every process exited 0
        return 0
    except ChildFailedError as exc:
        failures = exc.failures  # global rank -> ProcessFailure, for the processes of this node that failed
        processes = int(args.nproc_per_node)  # given as a number (torchrun also takes "auto", "gpu")
        codes = [failure.exitcode for failure in failures.values()] + [0] * (processes - len(failures))
        code = exit_code(codes)
        for text in _reported(errors.name):
            say(f"error: {text}")
        if code != EXIT_RESUMABLE:
            said = ", ".join(f"rank {rank}: {_describe(failure.exitcode)}" for rank, failure in sorted(failures.items()))
            say(f"error: {len(failures)} of {processes} processes failed ({said}); their output is above")
        return code
    finally:
        os.environ.pop(ERRORS_ENV, None)
        errors.cleanup()
        for sig, handler in previous.items():  # from the command line: exiting with the code decided, not 143
            signal.signal(sig, signal.SIG_IGN if from_command_line() else handler)
