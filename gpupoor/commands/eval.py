"""`gpupoor eval`: the base and the tuned model side by side on held-out rows in the run's own format.

Each row's prompt is rendered and tokenized exactly as training did (the run's format, template and field names);
both models answer it greedily; each answer is scored against the row's expected one (`Format.expected_answer`)
by one or more metrics; and both models' eval loss on the rows' answers is measured (teacher-forced, as training's
eval). For an adapter the base column is the same weights with the adapter switched off, so the two columns
differ only by what training learned. `--general` adds a few questions any instruction-tuned base answers, to
show what fine-tuning broke. The table is printed and written as JSON beside the run (RUN/eval/NAME.json)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gpupoor import faults
from gpupoor.errors import UserError
from gpupoor.scorers import SCORER_HELP, Scorer, parse_scorer

# Questions a base instruction model answers and a word any sensible answer contains (as the real demo's judge).
GENERAL = (("What is the capital of France?", "paris"), ("What is the opposite of hot?", "cold"))
BATCH = 16
SHOWN_CHARACTERS = 200  # of an answer in the printed table; the JSON keeps it whole
METRIC_HELP = SCORER_HELP.replace("returning a bool or a number", "returning a bool or a number in [0, 1]")


def parse_metric(spec: str) -> Scorer:
    """One --metric value (gpupoor.scorers: the scorers GRPO's rewards use too)."""
    return parse_scorer(spec, "--metric", unit_range=True)


@dataclass(frozen=True)
class Requirement:
    """`--pass-if`: what the tuned model must reach for exit 0: a metric's mean (`exact>=0.8`), its rise over the
    base (`exact-gain>=0.5`), or the general questions it still answers (`general>=2`)."""

    text: str
    name: str
    gain: bool
    least: float

    def shortfall(self, columns: list) -> str | None:
        """Why the tuned model misses it, or None."""
        base, tuned = (columns[0] if len(columns) > 1 else None), columns[-1]
        if self.name == "general":
            value = tuned.general_kept
            return None if value >= self.least else f"{self.text}: {value} general questions still answered"
        value = tuned.mean(self.name) - (base.mean(self.name) if self.gain else 0.0)
        if value >= self.least - 1e-12:
            return None
        return f"{self.text}: it gained {value:+.0%}" if self.gain else f"{self.text}: it reached {value:.0%}"


PASS_IF_FORMS = (f"METRIC>=X (its mean, X from 0 to 1), METRIC-gain>=X (its rise over the base, X from -1 to 1) or "
                 f"general>=N (general questions still answered, N from 0 to {len(GENERAL)}, with --general)")
PASS_IF_EXAMPLES = "e.g. --pass-if 'exact>=0.8' --pass-if 'exact-gain>=0.5' --pass-if 'regex:^\\d+$>=0.9'"
# Longest first: a run of operator characters ends in one of these; what comes before it belongs to the metric
# (a regex: metric may hold `>=` or `=` of its own).
COMPARISONS = (">=", "<=", "==", "!=", "=>", "=<", ">", "<", "=")
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_requirement(spec: str) -> Requirement:
    """One --pass-if value, split at its last comparison (so `regex:^a>=b$>=0.5` is the metric `regex:^a>=b$`),
    every part checked: the comparison is >=, the bound a finite number the tuned model can reach."""
    found = re.fullmatch(r"(.*?)([<>=!]+)([^<>=!]*)", spec.strip(), re.DOTALL)
    if not found or not found.group(1).strip():
        raise UserError(f"--pass-if {spec!r}: write {PASS_IF_FORMS}", hint=PASS_IF_EXAMPLES)
    left, run, bound = found.groups()
    comparison = next((c for c in COMPARISONS if run.endswith(c)), run)
    if comparison != ">=":
        raise UserError(f"--pass-if {spec!r}: the comparison is {comparison!r}; --pass-if takes >= only (what the "
                        "tuned model must reach at least)", hint=f"write {PASS_IF_FORMS}")
    metric = (left + run[:-len(comparison)]).strip()
    gain = metric.endswith("-gain")
    name = metric.removesuffix("-gain") if gain else metric
    if not NUMBER.fullmatch(bound.strip()):
        raise UserError(f"--pass-if {spec!r}: {bound.strip()!r} is not a finite number", hint=f"write {PASS_IF_FORMS}")
    least = float(bound)
    if name == "general":
        if gain or least != int(least) or not 0 <= least <= len(GENERAL):
            raise UserError(f"--pass-if {spec!r}: --general asks {len(GENERAL)} questions, so write general>=N "
                            f"with N a whole number from 0 to {len(GENERAL)}")
    elif not (-1.0 if gain else 0.0) <= least <= 1.0:
        span, what = ("-1 to 1", "its rise over the base") if gain else ("0 to 1", "its mean")
        raise UserError(f"--pass-if {spec!r}: X is {what}, from {span} (a metric scores each answer from 0 to 1), "
                        f"not {least:g}", hint=f"write {PASS_IF_FORMS}")
    return Requirement(spec.strip(), name, gain, least)


@dataclass
class HeldOut:
    """One held-out row: where it is, its prompt's ids, the answer it expects, and its ids and labels for the loss."""

    where: str
    row: dict
    prompt: list[int]
    expected: str
    example: tuple  # (input_ids, labels) tensors, training's encoding of the whole row


def read_held_out_rows(data: Path, limit: int | None) -> list:
    """The rows of --data (a JSONL or any data file training reads), read before any model loads so that a wrong
    path or a malformed line costs no loading time. Messages and each row's `file:line` name the file as the user
    typed it (`/dev/stdin`, not the /proc/PID/fd/... it resolves to)."""
    from gpupoor.data.loading import Row, read_rows, resolve_source
    from gpupoor.recipe.loading import DATA_SUFFIXES, resolve_local_path

    typed = str(data)
    local = resolve_local_path(typed, Path.cwd(), DATA_SUFFIXES)  # None: a dataset on the hub
    named = data.expanduser()
    allowed = f"a file of held-out rows ({', '.join(DATA_SUFFIXES)}) or a datasets.save_to_disk directory"
    if local is not None:
        if not named.exists():
            raise UserError(f"--data {typed}: no such file", hint=f"give --data {allowed}; a relative path is read "
                            f"from the current directory ({Path.cwd()})")
        if not (named.is_file() or named.is_dir()):
            raise UserError(f"--data {typed}: not a regular file (a pipe, socket or device); eval reads the rows by "
                            "their file's suffix", hint=f"save the rows to a .jsonl file and give its path: {allowed}")
        if named.is_file() and local.suffix.lower() not in DATA_SUFFIXES:
            raise UserError(f"--data {typed}: not a data file eval reads", hint=f"give --data {allowed}")
    try:
        rows = read_rows(resolve_source(typed, Path.cwd(), "train", "--data"), limit)
    except UserError as exc:
        if local is None or str(local) == typed:
            raise
        raise UserError(exc.message.replace(str(local), typed), hint=exc.hint) from None
    if not rows:
        raise UserError(f"--data {typed}: no rows in it", hint="give held-out rows in the run's format")
    if local is not None and str(local) != typed:
        rows = [Row(row.fields, typed + row.where.removeprefix(str(local))) for row in rows]
    return rows


def check_expected_answers(rows: list, source: Path, checkpoint: str) -> None:
    """Each held-out row holds its answer in the run's format (alpaca's output, a chat's last assistant turn):
    checked from the stored recipe, before any model loads. A plain model directory has no recipe: its format
    comes from its tokenizer, and encode_held_out checks its rows once that is loaded."""
    from gpupoor.data.row_formats import FORMATS, FieldNames
    from gpupoor.storage.rundir import stored_recipe
    from gpupoor.storage.run_weights import locate_weights

    run_dir = locate_weights(source, checkpoint).run_dir if rows and source.is_dir() else None
    if run_dir is None:
        return
    data = stored_recipe(run_dir).data
    fields = (data.sources() or [data])[0]
    fmt = FORMATS[fields.format](FieldNames.of(fields, data.sharegpt_roles))
    for row in rows:
        fmt.expected_answer(dict(row.fields), row.where)


def encode_held_out(rows: list, encoder) -> list[HeldOut]:
    """Each row in the run's format, checked to hold its expected answer; errors name file:line."""
    import torch

    held_out = []
    for row in rows:
        fields = dict(row.fields)
        expected = encoder.format.expected_answer(fields, row.where)
        encoded = encoder.encode(fields, row.where)
        held_out.append(HeldOut(row.where, fields, encoder.encode_prompt(fields, row.where), expected,
                                (torch.tensor(encoded.input_ids), torch.tensor(encoded.labels))))
    return held_out


@dataclass
class Column:
    """One model's results."""

    name: str
    answers: list[str]
    scores: dict[str, list[float]]  # metric -> one score per row
    eval_loss: float
    general: list[str] = field(default_factory=list)
    seconds: float = 0.0
    answer_tokens: int = 0  # generated for the rows' answers (each up to its end of sequence)
    answer_seconds: float = 0.0  # the time they took (the eval loss and the general questions apart)

    def mean(self, metric: str) -> float:
        values = self.scores[metric]
        return sum(values) / len(values)

    @property
    def general_kept(self) -> int:
        return sum(word in answer.lower() for (_, word), answer in zip(GENERAL, self.general))


def score_model(name: str, generator, rows: list[HeldOut], metrics: list[Scorer], general: list[list[int]],
                max_new_tokens: int, say: Callable[[str], None]) -> Column:
    """`generator`'s model answers every row (a line of progress per batch, with the time left), is scored, and
    its eval loss measured."""
    from gpupoor.model.generation import cap_new_tokens, complete
    from gpupoor.objectives.cross_entropy import mean_nll
    from gpupoor.units import ProgressLine

    started = time.monotonic()
    prompts = [row.prompt for row in rows]
    new_tokens, _ = cap_new_tokens(generator.model, prompts + general, max_new_tokens)
    progress = ProgressLine(len(prompts), say, name, "rows answered", every_s=0)
    answers: list[str] = []
    counts: list[int] = []
    answering = time.monotonic()
    for start in range(0, len(prompts), BATCH):
        batch = complete(generator.model, generator.tokenizer, prompts[start:start + BATCH], new_tokens,
                         counts=counts)
        answers += batch
        progress.tick(len(batch))
    answer_seconds = time.monotonic() - answering
    scores = {m.name: [m(answer, row.expected, row.row, row.where) for answer, row in zip(answers, rows)]
              for m in metrics}
    loss, _ = mean_nll(generator.model, [row.example for row in rows])
    general_answers = complete(generator.model, generator.tokenizer, general, new_tokens) if general else []
    return Column(name, answers, scores, loss, general_answers, time.monotonic() - started, sum(counts),
                  answer_seconds)


def evaluate(source: Path, *, data: Path | None, metrics: list[str], checkpoint: str = "final",
             general: bool = False, limit: int | None = None, max_new_tokens: int = 64, output: Path | None = None,
             force: bool = False, tasks: list[str] | None = None, pass_if: list[str] | None = None,
             say: Callable[[str], None] = print, progress: Callable[[str], None] = print) -> dict:
    """The eval report of the model at `source` on the rows of `data` (see the module's doc) and, with `tasks`, on
    lm-evaluation-harness's tasks (gpupoor/commands/eval_tasks.py); written as JSON. Every input is checked
    before the model loads: a real evaluation takes minutes, and bad input must not cost them."""
    from gpupoor.model.generation import load_generator
    from gpupoor.storage.files import write_text_atomic

    if data is None and not tasks:
        raise UserError("nothing to evaluate on", hint="give --data HELD_OUT.jsonl (rows in the run's format), "
                        "--tasks NAME (lm-evaluation-harness), or both")
    chosen = [parse_metric(spec) for spec in dict.fromkeys(metrics or ["exact"])]
    required = _requirements(pass_if or [], [m.name for m in chosen], general, data, _has_base(source, checkpoint))
    rows = read_held_out_rows(data, limit) if data is not None else []
    check_expected_answers(rows, source, checkpoint)
    prepared = None
    if tasks:
        from gpupoor.commands.eval_tasks import prepare_tasks

        prepared = prepare_tasks(tasks)
    target = output or _default_output(source, data)
    check_output(target, output is not None, source, data, prepared.files if prepared else [])

    generator = load_generator(source, checkpoint, force=force, warn=lambda text: say(f"warning: {text}"))
    held_out = encode_held_out(rows, generator.encoder)
    if generator.precision_note:
        say(generator.precision_note)
    if getattr(generator.model, "disable_adapter", None) is None:
        say("no base column: this is a whole model, not an adapter on a base (evaluate the base model directory "
            "on its own to compare)")
    report, columns = _held_out_report(generator, data, held_out, chosen, general, max_new_tokens, say, progress) \
        if held_out else ({}, [])
    if required:
        reasons = [why for why in (r.shortfall(columns) for r in required) if why]
        report["verdict"] = {"passed": not reasons, "pass_if": [r.text for r in required], "reasons": reasons}
        say(("FAIL: " + "; ".join(reasons)) if reasons else f"PASS: {', '.join(r.text for r in required)}")
    if prepared is not None:
        from gpupoor.commands.eval_tasks import render_tasks, run_tasks

        report["tasks"] = run_tasks(generator, prepared, limit, progress)
        say(render_tasks(report["tasks"]))
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, json.dumps(report, indent=2) + "\n")
    say(f"wrote {target}")
    return report


def _has_base(source: Path, checkpoint: str) -> bool | None:
    """Whether the model at `source` is an adapter, whose base column a gain is measured against; None when
    `source` is no directory (loading it says why)."""
    from gpupoor.storage.run_weights import locate_weights

    return locate_weights(source, checkpoint).is_adapter if source.is_dir() else None


def check_output(target: Path, explicit: bool, source: Path, data: Path | None, task_files: list[Path]) -> None:
    """Before any work, that the report can be written at `target`: not a directory, in a folder that exists (or,
    for the default RUN/eval/, can be made) and that this user can write, and not one of the inputs (the held-out
    rows, a task YAML, the model's own files), which it would overwrite."""
    import errno
    import tempfile

    from gpupoor.storage.files import blocking_file

    option = f"--output {target}" if explicit else f"the report's default path {target}"
    fix = "give --output a file path in a folder you can write" if explicit else "give --output FILE elsewhere"
    if target.is_dir():
        raise UserError(f"{option} is a directory", hint=f"name a file, e.g. --output {target / 'eval.json'}")
    if target.exists() and not target.is_file():  # a device or a pipe: the report is renamed into place over it
        raise UserError(f"{option} is not a regular file (a device, pipe or socket)", hint=fix)
    folder = target.absolute().parent
    blocker = blocking_file(folder)
    if blocker is not None:
        raise UserError(f"{option}: {blocker} is a file, not a directory", hint=fix)
    if explicit and not folder.is_dir():
        raise UserError(f"{option}: the folder {folder} does not exist",
                        hint=f"create it first (mkdir -p {folder}) or give --output a path in an existing folder")
    probe = next(place for place in (folder, *folder.parents) if place.is_dir())  # RUN/eval/ is made when written
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk's failure, not the input's: exit 1 naming it
            raise
        raise UserError(f"{option}: cannot write in {probe} ({exc.strerror or exc})", hint=fix) from None
    if target.exists():
        inputs = [(data, "the --data file"), *((path, "a --tasks file") for path in task_files)]
        for path, what in inputs:
            if path is not None and path.expanduser().exists() and target.samefile(path.expanduser()):
                raise UserError(f"{option} is {what}: writing the report would overwrite it",
                                hint="give --output another file for the report")
        inside = source.is_dir() and target.resolve().is_relative_to(source.resolve())
        if inside and not target.resolve().is_relative_to((source / "eval").resolve()):
            raise UserError(f"{option} is a file of the model at {source}: writing the report would overwrite it",
                            hint="give --output a file outside the model's directory (RUN/eval/ is the default)")


def _held_out_report(generator, data: Path, rows: list[HeldOut], chosen: list[Scorer], general: bool,
                     max_new_tokens: int, say, progress) -> tuple[dict, list[Column]]:
    """Both columns on the held-out rows: scored, printed, and as the report's data."""
    general_prompts = [generator.encoder.encode_prompt(generator.encoder.format.prompt_row(question), "--general")
                       for question, _ in GENERAL] if general else []
    columns = []
    switch = getattr(generator.model, "disable_adapter", None)  # a peft model: the base is the adapter off
    if switch is not None:
        with switch():
            columns.append(score_model("base", generator, rows, chosen, general_prompts, max_new_tokens, progress))
    faults.at_stage("working")  # tests: a signal between the two columns
    columns.append(score_model("tuned", generator, rows, chosen, general_prompts, max_new_tokens, progress))
    report = {"data": str(data), "rows": len(rows), "metrics": [m.name for m in chosen],
              "columns": [{k: v for k, v in asdict(c).items() if k != "answers"} | {
                  "means": {m.name: c.mean(m.name) for m in chosen}} for c in columns],
              "examples": [{"where": row.where, "expected": row.expected,
                            **{c.name: c.answers[i] for c in columns}} for i, row in enumerate(rows)]}
    say(render(report, columns, chosen, rows, general))
    return report, columns


def _requirements(specs: list[str], metrics: list[str], general: bool, data: Path | None,
                  has_base: bool | None) -> list[Requirement]:
    """--pass-if, checked before any work: each names a metric scored (or `general`, with --general), and a gain
    a model with a base column."""
    required = [parse_requirement(spec) for spec in specs]
    for requirement in required:
        if data is None:
            raise UserError(f"--pass-if {requirement.text!r}: needs --data, the held-out rows it is measured on")
        if requirement.name == "general" and not general:
            raise UserError(f"--pass-if {requirement.text!r}: add --general, which asks the general questions")
        if requirement.name != "general" and requirement.name not in metrics:
            raise UserError(f"--pass-if {requirement.text!r}: {requirement.name} is not among the metrics scored "
                            f"({', '.join(metrics)}); it can name one of those or general",
                            hint=f"add --metric '{requirement.name}', or name a metric scored")
        if requirement.gain and has_base is False:
            raise UserError(f"--pass-if {requirement.text!r}: a gain needs the base column, which a whole model has not",
                            hint="use METRIC>=X on a whole model, or evaluate an adapter run")
    return required


def _default_output(source: Path, data: Path | None) -> Path:
    """RUN/eval/NAME.json for a run directory (NAME: the data file's, or `tasks`); else eval-NAME.json beside the
    data file (or in the current directory)."""
    name = f"{data.stem if data is not None else 'tasks'}.json"
    if (source / "recipe.yaml").is_file():
        return source / "eval" / name
    return (data.parent if data is not None else Path.cwd()) / f"eval-{name}"


def render(report: dict, columns: list[Column], metrics: list[Scorer], rows: list[HeldOut], general: bool,
           examples: int = 5) -> str:
    """A plain table a terminal shows as it is: one line per figure, one column per model; then the first rows
    whose answers differ between the models (or, with one model, the first rows it got wrong)."""
    names = [c.name for c in columns]
    width = max(24, *(len(m.name) + 2 for m in metrics))
    lines = [f"{'':{width}}" + "".join(f"{name:>16}" for name in names)]
    for m in metrics:
        lines.append(f"{m.name:{width}}" + "".join(
            f"{f'{sum(c.scores[m.name]):.0f}/{len(rows)} ({c.mean(m.name):.0%})':>16}" for c in columns))
    lines.append(f"{'eval loss':{width}}" + "".join(f"{c.eval_loss:>16.4f}" for c in columns))
    lines.append(f"{'answer tokens/s':{width}}" + "".join(
        f"{c.answer_tokens / max(c.answer_seconds, 1e-9):>16.1f}" for c in columns))
    if general:
        lines.append(f"{'general questions kept':{width}}" + "".join(
            f"{f'{c.general_kept}/{len(GENERAL)}':>16}" for c in columns))
        for i, (question, word) in enumerate(GENERAL):
            lines.append(f"  {question} (must say {word!r}): " + "; ".join(
                f"{c.name} {clip(c.general[i])}" for c in columns))
    first = metrics[0].name
    differing = [i for i in range(len(rows)) if (len({c.answers[i] for c in columns}) > 1 if len(columns) > 1
                                                 else columns[0].scores[first][i] < 1)]
    if differing:
        lines.append(f"first rows where {'the models differ' if len(columns) > 1 else 'the answer is not ' + first}:")
    here = f"{Path.cwd()}/"
    for i in differing[:examples]:
        lines.append(f"  {rows[i].where.removeprefix(here)}: expected {clip(rows[i].expected)}; " + "; ".join(
            f"{c.name} {clip(c.answers[i])}" for c in columns))
    return "\n".join(lines)


def clip(text: str, most: int = SHOWN_CHARACTERS) -> str:
    """A text as the printed table shows it: quoted whole up to `most` characters, else its first `most`, an
    ellipsis and its length, so a model that rambles for kilobytes does not bury the table (the JSON report keeps
    every answer whole)."""
    if len(text) <= most:
        return repr(text)
    return f"{text[:most]!r}... ({len(text)} characters)"
