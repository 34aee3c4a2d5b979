"""How a verb of the `gpupoor` command is declared (gpupoor/cli.py is the table of verbs): the `verb` decorator
that runs every command's body the same way (guarded, --debug, train's and resume's stop requests and launch), the
launch options train and resume share, and the options several verbs declare alike."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Optional

import typer

from gpupoor.errors import UserError
from gpupoor.outcome import guarded, with_stop_requests

DEBUG_HELP = "Show full tracebacks."
SET_HELP = "Override a recipe key, e.g. --set training.max_steps=100 (value parsed as YAML). Repeatable."

# Options several verbs declare alike (typer reads an option's declaration; one object may serve several commands).
SET = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP)
SOURCE = typer.Argument(..., help="A run directory, an adapter directory or a model directory.")
CHECKPOINT = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints.")
FORCE_BASE = typer.Option(False, "--force", help="Go on when the base model changed since the run trained on it (by "
                          "default that is refused, exit 2).")
BASE = typer.Option(None, "--base", help="Base model for an adapter (default: the one it names).")
TEMPERATURE = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy (reproducible).")


def warn(text: str) -> None:
    typer.echo(f"warning: {text}", err=True)


# The options the wrapper gives a verb's body rather than typer: when the command started, its stop requests.
GIVEN = ("started", "stop")


def verb(*, stops: bool = False, launches: bool = False):
    """A CLI verb: its body returns its exit code and runs the way every verb ends (gpupoor.outcome.guarded: bad
    input exits 2 with one line, a failure 1, tracebacks only with --debug); --debug is added to its options (a
    body that reads it declares `debug: bool = False`). `stops` (train, resume): SIGTERM/SIGINT/SIGUSR1 noted from
    the first line (outcome.with_stop_requests), handed to the body as `stop`. `launches`: with --nproc-per-node,
    the processes are launched instead (`launch_if_asked`). A body that declares `started` gets the time.monotonic()
    of the command's first line."""

    def wrap(body):
        signature = inspect.signature(body, eval_str=True)
        debug_option = typer.Option(False, "--debug", help=DEBUG_HELP)
        options = [parameter.replace(default=debug_option) if parameter.name == "debug" else parameter
                   for parameter in signature.parameters.values() if parameter.name not in GIVEN]
        reads_debug = "debug" in signature.parameters
        if not reads_debug:
            options.append(inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=debug_option,
                                             annotation=bool))
        given = [name for name in GIVEN if name in signature.parameters]

        @functools.wraps(body)
        def command(*args, **kwargs):
            started = time.monotonic()  # a time limit counts from here
            debug = kwargs["debug"] if reads_debug else kwargs.pop("debug")
            if launches:
                launch_if_asked(kwargs["context"], debug)
            if "started" in given:
                kwargs["started"] = started
            if stops:
                guarded(debug, with_stop_requests(lambda stop: body(*args, stop=stop, **kwargs)))
            else:
                guarded(debug, lambda: body(*args, **kwargs))

        command.__signature__ = signature.replace(parameters=options, return_annotation=inspect.Signature.empty)
        command.__annotations__ = {parameter.name: parameter.annotation for parameter in options}
        return command

    return wrap


LAUNCH = "Launch several processes (torchrun's options; exit 75 kept)"
# name -> (its type, its typer option): added to train and resume by `launch_options`, declared only here.
LAUNCH_OPTIONS = {
    "nproc_per_node": (Optional[int], typer.Option(None, "--nproc-per-node", min=1, rich_help_panel=LAUNCH, help=(
        "Start N training processes on this machine through torchrun's launcher (torch.distributed.run) and exit "
        "with gpupoor's code for all of them: 75 when every process stopped with a checkpoint, where torchrun "
        "says 1."))),
    "nnodes": (str, typer.Option("1", "--nnodes", rich_help_panel=LAUNCH, help="Machines taking part: run the "
                                 "same command on each (with --nproc-per-node).")),
    "node_rank": (int, typer.Option(0, "--node-rank", min=0, rich_help_panel=LAUNCH,
                                    help="This machine's number, 0 to NNODES-1 (with --master-addr).")),
    "master_addr": (str, typer.Option("127.0.0.1", "--master-addr", rich_help_panel=LAUNCH,
                                      help="The address of node 0, which every node reaches.")),
    "master_port": (Optional[int], typer.Option(None, "--master-port", min=1, max=65535, rich_help_panel=LAUNCH,
                                                help="A free port on node 0 (default 29500; one machine alone "
                                                "picks a free one).")),
    "rdzv_endpoint": (Optional[str], typer.Option(None, "--rdzv-endpoint", rich_help_panel=LAUNCH, help=(
        "HOST:PORT where the nodes meet (torchrun's c10d rendezvous), instead of --master-addr and --node-rank."))),
}
LAUNCH_PARAMS = tuple(LAUNCH_OPTIONS)


def launch_options(command):
    """The command with the launch options (LAUNCH_OPTIONS) after its own, for typer to parse. The command itself
    does not take them: `_launch_if_asked` reads them from its context."""
    signature = inspect.signature(command, eval_str=True)
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
             for name, (kind, option) in LAUNCH_OPTIONS.items()]

    @functools.wraps(command)
    def with_launch_options(*args, **kwargs):
        return command(*args, **{key: value for key, value in kwargs.items() if key not in LAUNCH_OPTIONS})

    with_launch_options.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *added])
    with_launch_options.__annotations__ = {**{p.name: p.annotation for p in signature.parameters.values()},
                                           **{p.name: p.annotation for p in added}}
    return with_launch_options


def launch_if_asked(context: typer.Context, debug: bool) -> None:
    """With --nproc-per-node: run this command in the processes torchrun's launcher starts, and exit with their
    code (gpupoor.run.launch). Launch options without it are refused. Otherwise return: train here."""
    # (by name: typer carries its own copy of click, whose ParameterSource is not click's)
    given = [f"--{name.replace('_', '-')}" for name in LAUNCH_PARAMS[1:]
             if getattr(context.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]
    nproc_per_node = context.params["nproc_per_node"]
    if nproc_per_node is None and not given:
        return

    def action() -> int:
        if nproc_per_node is None:
            raise UserError(f"{', '.join(given)} without --nproc-per-node: they say how to launch processes",
                            hint="add --nproc-per-node N (the processes on each machine)")
        from gpupoor.commands.train import launch_processes

        return launch_processes(context, LAUNCH_PARAMS, debug, say=lambda text: typer.echo(text, err=True))

    guarded(debug, action)  # exits
