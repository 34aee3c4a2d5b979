"""The `gpupoor` command, a table of verbs: each one's typer declaration (its options with their help) and one call
into gpupoor/commands/, where what it does lives. How a verb is declared and ends (guarded, --debug, train's and
resume's stop requests and launch) is gpupoor/verb.py; exit codes and messages, gpupoor/outcome.py. Heavy imports
(torch, transformers) happen inside the verbs, so --help is instant."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from gpupoor import __version__
from gpupoor.commands.eval import METRIC_HELP
from gpupoor.errors import EXIT_FAILED, UserError
from gpupoor.export.format_table import DEFAULT_FORMAT, format_help, quant_help
from gpupoor.quiet import flags_show_no_type
from gpupoor.run.startup import started_by_command_line
from gpupoor.train.heap import serve_tensors_from_heap
from gpupoor.verb import (BASE, CHECKPOINT, FORCE_BASE, SET, SET_HELP, SOURCE, TEMPERATURE, launch_options, verb,
                          warn)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Fine-tune Hugging Face causal LMs on the hardware you have, from a YAML recipe.")


flags_show_no_type()

MOST_PROCESSES = 2**20  # plan's --processes and --nodes: past any cluster, short of numbers that overflow its sums
MOST_THREADS = 4096  # plan's --threads: past any CPU's cores
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


@app.command()
@launch_options
@verb(stops=True, launches=True)
def train(
    context: typer.Context,
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    set_: Optional[list[str]] = SET,
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
    started: float = 0.0,
    stop=None,
) -> int:
    """Train from a recipe into a new run directory (or, with --resume-if-present, continue the run there)."""
    from gpupoor.commands.train import recipe_overrides, train as run_train

    return run_train(recipe, recipe_overrides(set_, time_limit, profile), output_dir, smoke=smoke, force=force,
                     resume_if_present=resume_if_present, started=started, stop=stop, warn=warn)


@app.command()
@launch_options
@verb(stops=True, launches=True)
def resume(
    context: typer.Context,
    run_dir: Path = typer.Argument(..., help="The run directory `gpupoor train` wrote."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP + " Changes that alter the training "
                                             "trajectory are refused unless --force."),
    force: bool = typer.Option(False, "--force", help="Resume even with trajectory-changing recipe changes "
                               "or changed data."),
    time_limit: Optional[str] = typer.Option(None, "--time-limit", help=TIME_LIMIT_HELP),
    profile: Optional[int] = typer.Option(None, "--profile", min=1, max=1000, help=PROFILE_HELP),
    started: float = 0.0,
    stop=None,
) -> int:
    """Continue a run exactly from its newest valid checkpoint."""
    from gpupoor.commands.train import resume as run_resume

    return run_resume(run_dir, set_, force=force, time_limit=time_limit, profile=profile, started=started, stop=stop)


@app.command()
@verb()
def status(
    run_dir: Path = typer.Argument(..., help="A run directory."),
) -> int:
    """Show a run's progress, its checkpoints (valid or why not) and how to continue."""
    from gpupoor.storage.rundir import require_run_dir
    from gpupoor.commands.status import status_report

    require_run_dir(run_dir)
    report, problem = status_report(run_dir.resolve())  # final/ is hashed once
    typer.echo(report)
    if problem not in (None, "absent"):
        raise UserError(f"{run_dir / 'final'}: {problem}",
                        hint=f"gpupoor resume {run_dir} writes final/ again from the last checkpoint")
    return 0


@app.command()
@verb()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="One or more run directories; several "
                                          "are overlaid on the same axes, labelled by directory name."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="X.html: one self-contained page with "
                                          "the figures and each run's summary; X.png: the figures only. "
                                          "Default: RUN_DIR/report.html for one run, ./report.html for several."),
    log_scale: bool = typer.Option(False, "--log-scale", help="Loss on a log scale (the HTML page embeds both "
                                   "scales; this picks the one shown first)."),
) -> int:
    """Plot loss and eval loss (with checkpoints, resumes, stops, skipped steps and the best checkpoint marked),
    learning rate, tokens/s and peak memory of one or more runs. Needs matplotlib (the `report` extra of gpupoor)."""
    from gpupoor.commands.report import write_report

    written = write_report(run_dirs, output, log_scale)
    typer.echo(f"wrote {written} ({written.stat().st_size / 1024:.0f} KiB)")
    return 0


@app.command("merge-lora")
@verb()
def merge_lora(
    source: Path = typer.Argument(..., help="A run directory or a PEFT adapter directory."),
    output: Path = typer.Option(..., "--output", help="New directory for the merged model (must not exist)."),
    checkpoint: str = CHECKPOINT,
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
    force: bool = FORCE_BASE,
) -> int:
    """Merge a LoRA, DoRA or IA3 adapter into its base, shard by shard, into a standard model directory. The
    adapter is checked against its manifest first."""
    from gpupoor.commands.merge import merge

    merge(source, output, checkpoint=checkpoint, dtype=dtype, base=base, max_shard_size=max_shard_size,
          qlora_base=qlora_base, verify=verify, check_files=not skip_manifest_check, force=force,
          say=typer.echo)
    return 0


@app.command()
@verb()
def export(
    source: Path = typer.Argument(..., help="A run directory, a PEFT adapter directory or a model directory."),
    quant: list[str] = typer.Option([], "--quant", "-q", metavar="TYPE", show_default=False, help=quant_help()),
    fmt: str = typer.Option(DEFAULT_FORMAT, "--format", help=format_help()),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The .gguf file to write (with several "
                                          "--quant, -QUANT is added before .gguf). Default: RUN_DIR/gguf/NAME-QUANT"
                                          ".gguf, or beside a model directory. Must not exist."),
    checkpoint: str = CHECKPOINT,
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="Text to measure perplexity on: .txt or .md, or "
                                             ".jsonl rows with a \"text\" field. Default: the run's eval set."),
    eval_tokens: int = typer.Option(16384, "--eval-tokens", min=1, help="Score at most about this many target "
                                    "tokens."),
    quality: bool = typer.Option(True, "--quality/--no-quality", help="Measure each file's perplexity against "
                                 "the full-precision model (loads each file back with transformers)."),
    force: bool = FORCE_BASE,
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Where an adapter is merged into its base "
                                            "first: a temporary fp32 model, 4 bytes a parameter (~32 GB for an 8B "
                                            "model), removed at the end. Default: the output folder."),
) -> int:
    """Write the trained model as GGUF files (adapter merged first) and measure what each quantization costs in
    perplexity: a table printed and written as NAME.quality.json, with an Ollama Modelfile beside each file."""
    from gpupoor.commands.export import export as run_export
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()
    # SIGTERM / SIGHUP come out as gpupoor.errors.Terminated: _guarded says them and exits 143 / 129.
    run_export(source, quants=quant, fmt=fmt, output=output, checkpoint=checkpoint, eval_file=eval_file,
               eval_tokens=eval_tokens, quality=quality, say=typer.echo, force=force, work_dir=work_dir)
    return 0


@app.command("eval")
@verb()
def evaluate(
    source: Path = SOURCE,
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
    checkpoint: str = CHECKPOINT,
    general: bool = typer.Option(False, "--general", help="Also ask a few questions any instruction-tuned base "
                                 "answers, to see what fine-tuning broke."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Score only the first N rows."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="The longest answer, in tokens."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The JSON report, in a folder that exists "
                                          "(never one of the inputs). Default: RUN_DIR/eval/NAME.json, or "
                                          "eval-NAME.json beside the data."),
    force: bool = FORCE_BASE,
) -> int:
    """Score the base and the tuned model side by side on held-out rows: greedy answers in the run's format,
    each metric, the eval loss, and the first rows where they differ; written as JSON beside the run."""
    from gpupoor.commands.eval import evaluate as run_eval
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()
    report = run_eval(source, data=data, metrics=metric, checkpoint=checkpoint, general=general, limit=limit,
                      max_new_tokens=max_new_tokens, output=output, force=force, tasks=tasks, pass_if=pass_if,
                      say=typer.echo, progress=lambda text: typer.echo(text, err=True))
    return EXIT_FAILED if not report.get("verdict", {}).get("passed", True) else 0


@app.command()
@verb()
def serve(
    source: Path = SOURCE,
    checkpoint: str = CHECKPOINT,
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
    force: bool = FORCE_BASE,
) -> int:
    """Serve the tuned model over an OpenAI-compatible HTTP API (transformers' server: /v1/chat/completions,
    /v1/completions, /v1/models, streaming) with the run's chat template, until Ctrl-C, SIGTERM or SIGHUP.

    Requests are answered one at a time, in arrival order, each generating for at most --request-time-limit: a
    request waits at most that long for each one ahead of it. max_tokens is capped at the model's context less the
    prompt (the answer then ends with finish_reason length); a prompt that fills the context is refused (400,
    context_length_exceeded). Every request field is honoured or refused with a 400 naming it (docs/cli.md)."""
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


@app.command("convert-recipe")
@verb()
def convert_recipe(
    theirs: Path = typer.Argument(..., help="A LLaMA-Factory or axolotl training YAML."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The gpupoor recipe to write. Default: "
                                          "THEIRS.gpupoor.yaml beside it."),
    force: bool = typer.Option(False, "--force", help="Replace the output if it exists."),
) -> int:
    """Write a gpupoor recipe from a LLaMA-Factory or axolotl YAML; every key it could not carry over is listed
    at the top with the reason. Check the result with gpupoor validate."""
    from gpupoor.commands.convert import convert_recipe as run_convert

    run_convert(theirs, output=output, force=force, say=typer.echo)
    return 0


@app.command()
@verb()
def generate(
    source: Path = SOURCE,
    prompt: Optional[str] = typer.Option(None, "--prompt", help="One prompt (the instruction, user turn or text)."),
    file: Optional[Path] = typer.Option(None, "--file", "--input", help="A JSONL file of prompts: rows in the run's "
                                        "format, or {\"prompt\": ...}; - reads standard input (JSONL rows, or one "
                                        "prompt per line). Prints one JSON line per row. Piped input with neither "
                                        "option is read the same way."),
    checkpoint: str = CHECKPOINT,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = TEMPERATURE,
    fmt: Optional[str] = typer.Option(None, "--format", help="Prompt format (text | alpaca | chat | completion); default: "
                                      "the run's, or chat for a model with a chat template."),
    base: Optional[str] = BASE,
    force: bool = FORCE_BASE,
) -> int:
    """Sample from a trained model with the prompt format its run trained on (greedy by default)."""
    if fmt is not None and fmt not in ("text", "alpaca", "chat", "completion"):
        raise UserError(f"--format {fmt!r}: use text, alpaca, chat or completion")
    from gpupoor.commands.generate import answer_prompts, check_prompt_source, check_sampling

    check_sampling(temperature)
    check_prompt_source(prompt, file)
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()
    answer_prompts(source, checkpoint, base, fmt, prompt, file, max_new_tokens, temperature,
                   out=typer.echo, note=lambda text: typer.echo(f"note: {text}", err=True), force=force,
                   warn=warn)
    return 0


@app.command()
@verb()
def chat(
    source: Path = SOURCE,
    checkpoint: str = CHECKPOINT,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = TEMPERATURE,
    base: Optional[str] = BASE,
    force: bool = FORCE_BASE,
    history: Optional[bool] = typer.Option(None, "--history/--no-history", show_default=False, help="A chat run: "
                                           "carry the conversation from turn to turn, or answer each turn alone. "
                                           "Default: as the run's training rows were (conversations, or single "
                                           "exchanges)."),
) -> int:
    """Talk to the tuned model in its run's format, answers streamed: a chat run's turns, an alpaca run's
    instructions (/input TEXT: their input), a completion run's prompts; /system TEXT, /reset, /exit."""
    from gpupoor.commands.chat import StdinLines, chat as chat_loop
    from gpupoor.commands.generate import check_sampling
    from gpupoor.quiet import quiet_libraries

    check_sampling(temperature)
    quiet_libraries()
    write = lambda text: typer.echo(text, nl=False)  # noqa: E731
    chat_loop(source, checkpoint, base, max_new_tokens, temperature, read=StdinLines(sys.stdin.buffer, write),
              write=write, force=force, warn=warn, history=history)
    return 0


@app.command()
@verb()
def validate(
    recipes: list[Path] = typer.Argument(..., help="One or more recipe files."),
    set_: Optional[list[str]] = SET,
    force: bool = typer.Option(False, "--force", help="Do not fail a recipe the memory plan predicts not to fit the GPU."),
    show: int = typer.Option(0, "--show", min=0, metavar="N",
                             help="After the checks, print the first N training rows of each data source exactly as "
                             "training tokenizes them: trained text between « » (green on a terminal), token counts "
                             "(total / trained) and truncation. Loads the tokenizer, not the weights."),
    debug: bool = False,
) -> int:
    """Check recipes without loading weights: schema, data files and their format, the chat template, the
    model's config, and the memory plan (a recipe predicted not to fit the GPU fails). --show N prints rows as
    training will see them."""

    from gpupoor.commands.validate import validate_recipes

    return validate_recipes(recipes, set_ or [], force, show, debug, say=typer.echo,
                            err=lambda text: typer.echo(text, err=True), colour=sys.stdout.isatty())


@app.command()
@verb()
def plan(
    recipe: Path = typer.Argument(..., help="The recipe YAML file."),
    set_: Optional[list[str]] = SET,
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
) -> int:
    """Predict the peak memory of a recipe, term by term, without loading weights; say whether it fits and
    what to change when it does not; and how long it trains, against a time limit. Exit 0 when it fits (or the
    memory is unknown), 3 when it does not."""
    from gpupoor.commands.plan import check_plan_options, plan_recipe

    limit, timing = check_plan_options(device, memory, processes, nodes, time, time_limit, gpu, threads)
    return plan_recipe(recipe, set_ or [], device, limit, processes, nodes, as_json, fit, say=typer.echo,
                       timing=timing)


@app.command()
@verb()
def tokenize(
    recipe: Path = typer.Argument(..., help="The recipe YAML file: its data section, and its model's tokenizer."),
    output: Path = typer.Option(..., "--output", help="The directory to write (an earlier output of gpupoor "
                                "tokenize there is replaced atomically)."),
    set_: Optional[list[str]] = SET,
) -> int:
    """Tokenize a recipe's data once, into a directory that data.tokenized_path trains from: memory-mapped and
    read-only, so many runs and nodes can share it. Loads the tokenizer, no weights."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # worker processes are the parallelism
    from gpupoor.commands.tokenize import tokenize_recipe

    typer.echo(tokenize_recipe(recipe, set_ or [], output, warn))
    return 0


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
