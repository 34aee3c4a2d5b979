"""The `gpupoor` command: typer's declarations, the options parsed and checked. What a verb does lives in
gpupoor/commands/ (train and resume call the orchestrator from here); how every command ends (messages, exit
codes, signals) in gpupoor/outcome.py. Heavy imports (torch, transformers) happen inside commands so --help is
instant. It is longer than 600 lines because it declares every verb's options with their help, and nothing else:
each command's body is one call."""

from __future__ import annotations

import functools
import gc
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from gpupoor import __version__
from gpupoor.commands.eval import METRIC_HELP
from gpupoor.errors import EXIT_BAD_INPUT, EXIT_FAILED, UserError
from gpupoor.export.format_table import DEFAULT_FORMAT, format_help, quant_help
from gpupoor.outcome import guarded, with_stop_requests
from gpupoor.quiet import flags_show_no_type
from gpupoor.run.startup import started_by_command_line
from gpupoor.train.heap import serve_tensors_from_heap

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Fine-tune Hugging Face causal LMs on the hardware you have, from a YAML recipe.")


flags_show_no_type()

MOST_PROCESSES = 2**20  # plan's --processes and --nodes: past any cluster, short of numbers that overflow its sums
MOST_THREADS = 4096  # plan's --threads: past any CPU's cores
SET_HELP = "Override a recipe key, e.g. --set training.max_steps=100 (value parsed as YAML). Repeatable."
DEBUG_HELP = "Show full tracebacks."
FORCE_FIT_HELP = "Start even when the memory plan predicts that the recipe does not fit the GPU."
TIME_LIMIT_HELP = ("Stop with a checkpoint (exit 75) before this much wall-clock time has passed, e.g. 11h30m "
                   "(sets checkpoint.time_limit).")
PROFILE_HELP = ("Profile N optimizer steps after 2 warm-up steps (sets logging.profile_steps): a Chrome/Perfetto "
                "trace, the top operators and where the step time goes, in RUN_DIR/profile/.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpupoor {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


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


def _launch_if_asked(context: typer.Context, debug: bool) -> None:
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


def _warn(text: str) -> None:
    typer.echo(f"warning: {text}", err=True)


@app.command()
@launch_options
def train(
    context: typer.Context,
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", help="Run directory (overrides output_dir)."),
    smoke: bool = typer.Option(False, "--smoke", help="Check the recipe end to end in seconds: a shrunken "
                               "random-weight model of the same architecture, the first rows, a few CPU steps."),
    time_limit: Optional[str] = typer.Option(None, "--time-limit", help=TIME_LIMIT_HELP),
    force: bool = typer.Option(False, "--force", help=FORCE_FIT_HELP),
    profile: Optional[int] = typer.Option(None, "--profile", min=1, max=1000, help=PROFILE_HELP),
    resume_if_present: bool = typer.Option(False, "--resume-if-present", help="When the output directory already "
                                           "holds a run, resume it (with this recipe: changes that alter the "
                                           "trajectory are refused) instead of refusing: one command line for a "
                                           "batch job that is requeued after preemption."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Train from a recipe into a new run directory (or, with --resume-if-present, continue the run there)."""

    started = time.monotonic()  # a time limit counts from here
    _launch_if_asked(context, debug)

    def action(stop) -> int:
        from gpupoor.commands.train import (check_before_training, existing_run, exit_code, recipe_overrides,
                                            report_finished)
        from gpupoor.plan.time.assemble import check_environment
        from gpupoor.recipe.loading import load_recipe

        check_environment()
        loaded = load_recipe(recipe, recipe_overrides(set_, time_limit, profile))
        existing = existing_run(loaded, output_dir) if resume_if_present and not smoke else None
        if existing is not None:
            from gpupoor.run.orchestrate import resume_run

            return exit_code(report_finished(resume_run(existing, [], started=started, stop=stop, recipe=loaded)))
        plan = check_before_training(loaded, smoke, force, _warn)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from gpupoor.run.orchestrate import train_from_recipe

        result = train_from_recipe(loaded, output_dir, smoke=smoke, started=started, plan=plan, stop=stop)
        return exit_code(report_finished(result))

    guarded(debug, with_stop_requests(action))


@app.command()
@launch_options
def resume(
    context: typer.Context,
    run_dir: Path = typer.Argument(..., help="The run directory `gpupoor train` wrote."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP + " Changes that alter the training "
                                             "trajectory are refused unless --force."),
    force: bool = typer.Option(False, "--force", help="Resume even with trajectory-changing recipe changes "
                               "or changed data."),
    time_limit: Optional[str] = typer.Option(None, "--time-limit", help=TIME_LIMIT_HELP),
    profile: Optional[int] = typer.Option(None, "--profile", min=1, max=1000, help=PROFILE_HELP),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Continue a run exactly from its newest valid checkpoint."""
    started = time.monotonic()
    _launch_if_asked(context, debug)

    def action(stop) -> int:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from gpupoor.commands.train import exit_code, recipe_overrides, report_finished
        from gpupoor.plan.time.assemble import check_environment
        from gpupoor.run.orchestrate import resume_run

        check_environment()
        # --time-limit and --profile are this invocation's; --set changes are the run's from now on.
        return exit_code(report_finished(resume_run(run_dir, recipe_overrides(set_, None, None), force=force,
                                                    started=started, stop=stop,
                                                    invocation=recipe_overrides(None, time_limit, profile))))

    guarded(debug, with_stop_requests(action))


@app.command()
def status(
    run_dir: Path = typer.Argument(..., help="A run directory."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Show a run's progress, its checkpoints (valid or why not) and how to continue."""

    def action() -> int:
        from gpupoor.storage.rundir import require_run_dir
        from gpupoor.commands.status import status_report

        require_run_dir(run_dir)
        report, problem = status_report(run_dir.resolve())  # final/ is hashed once
        typer.echo(report)
        if problem not in (None, "absent"):
            raise UserError(f"{run_dir / 'final'}: {problem}",
                            hint=f"gpupoor resume {run_dir} writes final/ again from the last checkpoint")
        return 0

    guarded(debug, action)


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="One or more run directories; several "
                                          "are overlaid on the same axes, labelled by directory name."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="X.html: one self-contained page with "
                                          "the figures and each run's summary; X.png: the figures only. "
                                          "Default: RUN_DIR/report.html for one run, ./report.html for several."),
    log_scale: bool = typer.Option(False, "--log-scale", help="Loss on a log scale (the HTML page embeds both "
                                   "scales; this picks the one shown first)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Plot loss and eval loss (with checkpoints, resumes, stops, skipped steps and the best checkpoint marked),
    learning rate, tokens/s and peak memory of one or more runs. Needs matplotlib (the `report` extra of gpupoor)."""

    def action() -> int:
        from gpupoor.commands.report import write_report

        written = write_report(run_dirs, output, log_scale)
        typer.echo(f"wrote {written} ({written.stat().st_size / 1024:.0f} KiB)")
        return 0

    guarded(debug, action)


@app.command("merge-lora")
def merge_lora(
    source: Path = typer.Argument(..., help="A run directory or a PEFT adapter directory."),
    output: Path = typer.Option(..., "--output", help="New directory for the merged model (must not exist)."),
    checkpoint: str = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the base's dtype) | fp16 | bf16 | fp32."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model (hub id or directory); default: the "
                                       "one the adapter names."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest safetensors shard written."),
    qlora_base: str = typer.Option("dequantized", "--qlora-base", help="For QLoRA runs: dequantized (the base "
                                   "as trained, default) | original (the full-precision weights)."),
    verify: bool = typer.Option(False, "--verify", help="Report the max logit difference between the merged "
                                "model and base + adapter as trained (loads both)."),
    skip_manifest_check: bool = typer.Option(False, "--skip-manifest-check", help="Merge an adapter whose files "
                                             "no longer match the manifest gpupoor wrote (you edited them on "
                                             "purpose). Without it, a mismatch is an error (exit 2)."),
    force: bool = typer.Option(False, "--force", help="Go on when the base model changed since the run trained "
                               "on it (by default that is refused, exit 2)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Merge a LoRA, DoRA or IA3 adapter into its base, shard by shard, into a standard model directory. The
    adapter is checked against its manifest first."""

    def action() -> int:
        from gpupoor.commands.merge import merge

        merge(source, output, checkpoint=checkpoint, dtype=dtype, base=base, max_shard_size=max_shard_size,
              qlora_base=qlora_base, verify=verify, check_files=not skip_manifest_check, force=force,
              say=typer.echo)
        return 0

    guarded(debug, action)


@app.command()
def export(
    source: Path = typer.Argument(..., help="A run directory, a PEFT adapter directory or a model directory."),
    quant: list[str] = typer.Option([], "--quant", "-q", metavar="TYPE", show_default=False, help=quant_help()),
    fmt: str = typer.Option(DEFAULT_FORMAT, "--format", help=format_help()),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The .gguf file to write (with several "
                                          "--quant, -QUANT is added before .gguf). Default: RUN_DIR/gguf/NAME-QUANT"
                                          ".gguf, or beside a model directory. Must not exist."),
    checkpoint: str = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints."),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="Text to measure perplexity on: .txt or .md, or "
                                             ".jsonl rows with a \"text\" field. Default: the run's eval set."),
    eval_tokens: int = typer.Option(16384, "--eval-tokens", min=1, help="Score at most about this many target "
                                    "tokens."),
    quality: bool = typer.Option(True, "--quality/--no-quality", help="Measure each file's perplexity against "
                                 "the full-precision model (loads each file back with transformers)."),
    force: bool = typer.Option(False, "--force", help="Go on when the base model changed since the run trained "
                               "on it (by default that is refused, exit 2)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Where an adapter is merged into its base "
                                            "first: a temporary fp32 model, 4 bytes a parameter (~32 GB for an 8B "
                                            "model), removed at the end. Default: the output folder."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Write the trained model as GGUF files (adapter merged first) and measure what each quantization costs in
    perplexity: a table printed and written as NAME.quality.json, with an Ollama Modelfile beside each file."""

    def action() -> int:
        from gpupoor.commands.export import export as run_export
        from gpupoor.quiet import quiet_libraries

        quiet_libraries()
        # SIGTERM / SIGHUP come out as gpupoor.errors.Terminated: _guarded says them and exits 143 / 129.
        run_export(source, quants=quant, fmt=fmt, output=output, checkpoint=checkpoint, eval_file=eval_file,
                   eval_tokens=eval_tokens, quality=quality, say=typer.echo, force=force, work_dir=work_dir)
        return 0

    guarded(debug, action)


@app.command("eval")
def evaluate(
    source: Path = typer.Argument(..., help="A run directory, an adapter directory or a model directory."),
    data: Optional[Path] = typer.Option(None, "--data", help="Held-out rows in the run's format (JSONL or any data "
                                        "file training reads), each with its expected answer (alpaca: output; chat: "
                                        "the last assistant turn; completion: completion)."),
    pass_if: list[str] = typer.Option([], "--pass-if", show_default=False, help="Exit 1 unless the tuned model "
                                      "reaches it: METRIC>=X (its mean, X from 0 to 1), METRIC-gain>=X (its rise "
                                      "over the base, X from -1 to 1), general>=N (with --general, N from 0 to 2); "
                                      "METRIC is one of --metric's, any regex:PATTERN too (split at the last >=); "
                                      "repeatable. Checked before the model loads."),
    tasks: list[str] = typer.Option([], "--tasks", show_default=False, help="lm-evaluation-harness tasks (the "
                                    "`tasks` extra): a name it knows, or a task YAML file of yours; repeatable. Its "
                                    "own tasks download their datasets from the hub: they need a network."),
    metric: list[str] = typer.Option([], "--metric", "-m", show_default=False, help="How an answer is scored "
                                     "(repeatable; default exact): " + METRIC_HELP + "."),
    checkpoint: str = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints."),
    general: bool = typer.Option(False, "--general", help="Also ask a few questions any instruction-tuned base "
                                 "answers, to see what fine-tuning broke."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Score only the first N rows."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="The longest answer, in tokens."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The JSON report, in a folder that exists "
                                          "(never one of the inputs). Default: RUN_DIR/eval/NAME.json, or "
                                          "eval-NAME.json beside the data."),
    force: bool = typer.Option(False, "--force", help="Go on when the base model changed since the run trained "
                               "on it (by default that is refused, exit 2)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Score the base and the tuned model side by side on held-out rows: greedy answers in the run's format,
    each metric, the eval loss, and the first rows where they differ; written as JSON beside the run."""

    def action() -> int:
        from gpupoor.commands.eval import evaluate as run_eval
        from gpupoor.quiet import quiet_libraries

        quiet_libraries()
        report = run_eval(source, data=data, metrics=metric, checkpoint=checkpoint, general=general, limit=limit,
                          max_new_tokens=max_new_tokens, output=output, force=force, tasks=tasks, pass_if=pass_if,
                          say=typer.echo, progress=lambda text: typer.echo(text, err=True))
        return EXIT_FAILED if not report.get("verdict", {}).get("passed", True) else 0

    guarded(debug, action)


@app.command()
def serve(
    source: Path = typer.Argument(..., help="A run directory, an adapter directory or a model directory."),
    checkpoint: str = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints."),
    host: str = typer.Option("localhost", "--host", help="The address to listen on (localhost: this machine only)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="The port to listen on (checked free before "
                             "the merge)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="An existing folder where an adapter is merged "
                                            "into its base first (removed at exit, and at the next start if the "
                                            "server was killed). Default: the system's temporary folder."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id clients send "
                                                    "and /v1/models lists. Default: the run's (or model "
                                                    "directory's) name."),
    request_time_limit: str = typer.Option("2m", "--request-time-limit", help="The longest one request generates "
                                           "(e.g. 30s, 2m); its answer then ends with finish_reason length."),
    force: bool = typer.Option(False, "--force", help="Go on when the base model changed since the run trained "
                               "on it (by default that is refused, exit 2)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Serve the tuned model over an OpenAI-compatible HTTP API (transformers' server: /v1/chat/completions,
    /v1/completions, /v1/models, streaming) with the run's chat template, until Ctrl-C, SIGTERM or SIGHUP.

    Requests are answered one at a time, in arrival order, each generating for at most --request-time-limit: a
    request waits at most that long for each one ahead of it. max_tokens is capped at the model's context less the
    prompt (the answer then ends with finish_reason length); a prompt that fills the context is refused (400,
    context_length_exceeded). Every request field is honoured or refused with a 400 naming it (docs/cli.md)."""

    def action() -> int:
        from gpupoor.commands.serve import serve as run_server
        from gpupoor.quiet import quiet_libraries
        from gpupoor.units import parse_duration

        try:
            time_limit_s = parse_duration(request_time_limit)
        except ValueError as exc:
            raise UserError(f"--request-time-limit: {exc}") from None
        quiet_libraries()
        run_server(source, checkpoint=checkpoint, host=host, port=port, work_dir=work_dir, force=force,
                   served_model_name=served_model_name, request_time_limit_s=time_limit_s,
                   say=lambda text: typer.echo(text, err=True))
        return 0

    guarded(debug, action)


@app.command("convert-recipe")
def convert_recipe(
    theirs: Path = typer.Argument(..., help="A LLaMA-Factory or axolotl training YAML."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The gpupoor recipe to write. Default: "
                                          "THEIRS.gpupoor.yaml beside it."),
    force: bool = typer.Option(False, "--force", help="Replace the output if it exists."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Write a gpupoor recipe from a LLaMA-Factory or axolotl YAML; every key it could not carry over is listed
    at the top with the reason. Check the result with gpupoor validate."""

    def action() -> int:
        from gpupoor.commands.convert import convert_recipe as run_convert

        run_convert(theirs, output=output, force=force, say=typer.echo)
        return 0

    guarded(debug, action)


@app.command()
def generate(
    source: Path = typer.Argument(..., help="A run directory, an adapter directory or a model directory."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="One prompt (the instruction, user turn or text)."),
    file: Optional[Path] = typer.Option(None, "--file", "--input", help="A JSONL file of prompts: rows in the run's "
                                        "format, or {\"prompt\": ...}; - reads standard input (JSONL rows, or one "
                                        "prompt per line). Prints one JSON line per row. Piped input with neither "
                                        "option is read the same way."),
    checkpoint: str = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy (reproducible)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="Prompt format (text | alpaca | chat | completion); default: "
                                      "the run's, or chat for a model with a chat template."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model for an adapter (default: the one it names)."),
    force: bool = typer.Option(False, "--force", help="Go on when the base model changed since the run trained "
                               "on it (by default that is refused, exit 2)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Sample from a trained model with the prompt format its run trained on (greedy by default)."""

    def action() -> int:
        if fmt is not None and fmt not in ("text", "alpaca", "chat", "completion"):
            raise UserError(f"--format {fmt!r}: use text, alpaca, chat or completion")
        from gpupoor.commands.generate import answer_prompts, check_prompt_source, check_sampling

        check_sampling(temperature)
        check_prompt_source(prompt, file)
        from gpupoor.quiet import quiet_libraries

        quiet_libraries()
        answer_prompts(source, checkpoint, base, fmt, prompt, file, max_new_tokens, temperature,
                       out=typer.echo, note=lambda text: typer.echo(f"note: {text}", err=True), force=force,
                       warn=_warn)
        return 0

    guarded(debug, action)


@app.command()
def chat(
    source: Path = typer.Argument(..., help="A run directory, an adapter directory or a model directory."),
    checkpoint: str = typer.Option("final", "--checkpoint", help="final, or step-N of a run's checkpoints."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy (reproducible)."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model for an adapter (default: the one it names)."),
    force: bool = typer.Option(False, "--force", help="Go on when the base model changed since the run trained "
                               "on it (by default that is refused, exit 2)."),
    history: Optional[bool] = typer.Option(None, "--history/--no-history", show_default=False, help="A chat run: "
                                           "carry the conversation from turn to turn, or answer each turn alone. "
                                           "Default: as the run's training rows were (conversations, or single "
                                           "exchanges)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Talk to the tuned model in its run's format, answers streamed: a chat run's turns, an alpaca run's
    instructions (/input TEXT: their input), a completion run's prompts; /system TEXT, /reset, /exit."""

    def action() -> int:
        from gpupoor.commands.chat import StdinLines, chat as chat_loop
        from gpupoor.commands.generate import check_sampling
        from gpupoor.quiet import quiet_libraries

        check_sampling(temperature)
        quiet_libraries()
        write = lambda text: typer.echo(text, nl=False)  # noqa: E731
        chat_loop(source, checkpoint, base, max_new_tokens, temperature, read=StdinLines(sys.stdin.buffer, write),
                  write=write, force=force, warn=_warn, history=history)
        return 0

    guarded(debug, action)


@app.command()
def validate(
    recipes: list[Path] = typer.Argument(..., help="One or more recipe files."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    force: bool = typer.Option(False, "--force", help="Do not fail a recipe the memory plan predicts not to fit the GPU."),
    show: int = typer.Option(0, "--show", min=0, metavar="N",
                             help="After the checks, print the first N training rows of each data source exactly as "
                             "training tokenizes them: trained text between « » (green on a terminal), token counts "
                             "(total / trained) and truncation. Loads the tokenizer, not the weights."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Check recipes without loading weights: schema, data files and their format, the chat template, the
    model's config, and the memory plan (a recipe predicted not to fit the GPU fails). --show N prints rows as
    training will see them."""

    def check(path: Path) -> str:
        """Raise on a bad recipe; return what to print on success."""
        from gpupoor.plan.make import preflight_plan
        from gpupoor.commands.validate import WHOLE_CHECK_BYTES, RowCheck, preflight, show_rows
        from gpupoor.recipe.loading import load_recipe
        from gpupoor.units import format_bytes

        loaded = load_recipe(path, set_ or [])
        notes: list[str] = []  # sources too big to read whole: which rows were checked
        warnings = preflight(loaded, RowCheck(WHOLE_CHECK_BYTES, notes.append))
        plan = preflight_plan(loaded, force, warnings.append)
        rows = show_rows(loaded, show, colour=sys.stdout.isatty()) if show else []
        for warning in warnings:
            typer.echo(f"{path}: warning: {warning}", err=True)
        memory = "" if plan is None else f" (predicted peak {format_bytes(plan.peak)} on {plan.device})"
        return "\n".join([f"{path}: ok{memory}", *(f"{path}: note: {note}" for note in notes), *rows])

    def action() -> int:
        failed = crashed = 0
        for path in recipes:
            try:
                typer.echo(check(path))
            except UserError as exc:
                if debug:
                    raise
                typer.echo(f"{path}: error: {exc}", err=True)
                failed += 1
            except Exception as exc:  # a bug, not bad input: report it (exit 1) but still check the next recipe
                if debug:
                    raise
                typer.echo(f"{path}: error: {type(exc).__name__}: {exc}\n  (run again with --debug for the "
                           "traceback)", err=True)
                crashed += 1
        return EXIT_FAILED if crashed else EXIT_BAD_INPUT if failed else 0

    guarded(debug, action)


@app.command()
def plan(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: the one training would use here)."),
    memory: Optional[str] = typer.Option(None, "--memory", help="Memory to fit in, e.g. 16GiB or 24GB (default: "
                                         "the GPU's free memory, or the available RAM for the CPU)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (peak_bytes and every term)."),
    fit: bool = typer.Option(False, "--fit", help="Write RECIPE.fit.yaml beside the recipe with the cheapest "
                             "changes predicted to make it fit."),
    processes: int = typer.Option(1, "--processes", envvar="WORLD_SIZE", min=1, max=MOST_PROCESSES, help="Plan one of N processes "
                                  "training together under distributed.strategy, and compare ddp with fsdp "
                                  "(default: $WORLD_SIZE, else 1)."),
    nodes: int = typer.Option(1, "--nodes", min=1, max=MOST_PROCESSES, help="The machines the processes run on (for the text; on "
                              "the CPU a node's processes share its RAM)."),
    time: bool = typer.Option(True, "--time/--no-time", help="Add the time plan: steps, a step's work term by "
                              "term, predicted step and total time (the first plan of a machine or of new data "
                              "measures them once, then reads its cache)."),
    time_limit: Optional[str] = typer.Option(None, "--time-limit", help="A session's time limit, e.g. 12h "
                                             "(default: checkpoint.time_limit): sessions needed, and --fit fits it."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="With --device cuda on a machine without it: plan the "
                                      "time on paper for this GPU (H100, A100, L4, T4, RTX4090, ...)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MOST_THREADS, help="CPU threads training will use (default: "
                                          "training.cpu_threads, else this process's cores)."),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Predict the peak memory of a recipe, term by term, without loading weights; say whether it fits and
    what to change when it does not; and how long it trains, against a time limit. Exit 0 when it fits (or the
    memory is unknown), 3 when it does not."""

    def action() -> int:
        from gpupoor.commands.plan import check_time_options, plan_recipe
        from gpupoor.plan.time.assemble import check_environment
        from gpupoor.units import parse_size

        if device is not None and device not in ("cpu", "cuda"):
            raise UserError(f"--device {device!r}: use cpu or cuda")
        limit = parse_size(memory, "--memory") if memory is not None else None
        if limit is not None and limit < 2**20:
            raise UserError(f"--memory {memory!r}: give the memory to fit in, e.g. 16GiB")
        if nodes > processes:
            raise UserError(f"--nodes {nodes} with --processes {processes}: every node runs at least one process")
        check_time_options(time_limit, gpu)
        if time:
            check_environment()
        ignored = [name for name, value in (("--time-limit", time_limit), ("--gpu", gpu), ("--threads", threads))
                   if value is not None]
        if not time and ignored:
            raise UserError(f"{', '.join(ignored)} with --no-time: the time plan reads them, and --no-time turns it "
                            "off", hint=f"drop --no-time, or drop {', '.join(ignored)}")
        timing = None if not time else {"threads": threads, "gpu": gpu, "time_limit": time_limit}
        return plan_recipe(recipe, set_ or [], device, limit, processes, nodes, as_json, fit, say=typer.echo,
                           timing=timing)

    guarded(debug, action)


@app.command()
def tokenize(
    recipe: Path = typer.Argument(..., help="The recipe YAML file: its data section, and its model's tokenizer."),
    output: Path = typer.Option(..., "--output", help="The directory to write (an earlier output of gpupoor "
                                "tokenize there is replaced atomically)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Tokenize a recipe's data once, into a directory that data.tokenized_path trains from: memory-mapped and
    read-only, so many runs and nodes can share it. Loads the tokenizer, no weights."""

    def action() -> int:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # worker processes are the parallelism
        from gpupoor.commands.tokenize import tokenize_recipe

        typer.echo(tokenize_recipe(recipe, set_ or [], output, _warn))
        return 0

    guarded(debug, action)


@app.command()
def schema() -> None:
    """Print the recipe JSON schema (for yaml-language-server / editor autocompletion)."""
    import json

    from gpupoor.recipe.loading import recipe_json_schema

    typer.echo(json.dumps(recipe_json_schema(), indent=2))


def main() -> None:
    # Start-up imports create a few million objects that live until exit; the cyclic garbage collector would
    # walk them again and again while they load (about 0.5 s here) and find nothing to free. Model-loading
    # verbs switch it back on once the libraries are in (quiet.quiet_libraries), before any tensor is made.
    gc.disable()
    started_by_command_line()
    # torch's CPU allocator: tensors of 2 MiB and more aligned to huge pages (and advised as such). Before torch
    # is imported (it reads this once). Measured on the CPU benchmark fixture: glibc then keeps far less freed
    # activation memory in its heap; the peak RSS fell 22-24% (checkpointing on: 978 -> 747 MiB; off: 1270 ->
    # 998 MiB) at the same step time (docs/benchmarks.md). THP_MEM_ALLOC_ENABLE=0 in the environment keeps
    # torch's default.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # And glibc serves blocks under 32 MiB from its heap and keeps its free top, so a step's activations reuse the
    # last step's pages instead of faulting fresh ones in (gpupoor.train.heap; 20-35% faster on the real model).
    serve_tensors_from_heap()
    try:
        app(prog_name="gpupoor")
    finally:
        # Leave every object to the process's end: interpreter shutdown otherwise walks them all once more.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
