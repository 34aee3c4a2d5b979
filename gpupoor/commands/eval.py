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

from gpupoor.errors import UserError
from gpupoor.scorers import SCORER_HELP, Scorer, parse_scorer

# Questions a base instruction model answers and a word any sensible answer contains (as the real demo's judge).
GENERAL = (("What is the capital of France?", "paris"), ("What is the opposite of hot?", "cold"))
BATCH = 16
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


def parse_requirement(spec: str) -> Requirement:
    found = re.fullmatch(r"\s*([\w:.]+?)(-gain)?\s*>=\s*(-?[0-9.]+)\s*", spec)
    if not found:
        raise UserError(f"--pass-if {spec!r}: write METRIC>=X (its mean), METRIC-gain>=X (its rise over the base) "
                        "or general>=N", hint="e.g. --pass-if exact>=0.8 --pass-if exact-gain>=0.5 --pass-if general>=2")
    return Requirement(spec.strip(), found.group(1), bool(found.group(2)), float(found.group(3)))


@dataclass
class HeldOut:
    """One held-out row: where it is, its prompt's ids, the answer it expects, and its ids and labels for the loss."""

    where: str
    row: dict
    prompt: list[int]
    expected: str
    example: tuple  # (input_ids, labels) tensors, training's encoding of the whole row


def read_held_out(path: Path, encoder, limit: int | None) -> list[HeldOut]:
    """The rows of a JSONL (or any data file training reads) in the run's format, each checked; errors name
    file:line."""
    import torch

    from gpupoor.data.loading import read_rows, resolve_source

    rows = read_rows(resolve_source(str(path), Path.cwd(), "train", "--data"), limit)
    if not rows:
        raise UserError(f"--data {path}: no rows in it", hint="give held-out rows in the run's format")
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
    from gpupoor.commands.generate import cap_new_tokens, complete
    from gpupoor.export.quality import mean_nll
    from gpupoor.units import ProgressLine

    started = time.monotonic()
    prompts = [row.prompt for row in rows]
    new_tokens, _ = cap_new_tokens(generator.model, prompts + general, max_new_tokens)
    progress = ProgressLine(len(prompts), say, name, "rows answered", every_s=0)
    answers: list[str] = []
    for start in range(0, len(prompts), BATCH):
        batch = complete(generator.model, generator.tokenizer, prompts[start:start + BATCH], new_tokens)
        answers += batch
        progress.tick(len(batch))
    scores = {m.name: [m(answer, row.expected, row.row, row.where) for answer, row in zip(answers, rows)]
              for m in metrics}
    loss, _ = mean_nll(generator.model, [row.example for row in rows])
    general_answers = complete(generator.model, generator.tokenizer, general, new_tokens) if general else []
    return Column(name, answers, scores, loss, general_answers, time.monotonic() - started)


def evaluate(source: Path, *, data: Path | None, metrics: list[str], checkpoint: str = "final",
             general: bool = False, limit: int | None = None, max_new_tokens: int = 64, output: Path | None = None,
             force: bool = False, tasks: list[str] | None = None, pass_if: list[str] | None = None,
             say: Callable[[str], None] = print, progress: Callable[[str], None] = print) -> dict:
    """The eval report of the model at `source` on the rows of `data` (see the module's doc) and, with `tasks`, on
    lm-evaluation-harness's tasks (gpupoor/commands/eval_tasks.py); written as JSON."""
    from gpupoor.commands.generate import load_generator
    from gpupoor.storage.files import write_text_atomic

    if data is None and not tasks:
        raise UserError("nothing to evaluate on", hint="give --data HELD_OUT.jsonl (rows in the run's format), "
                        "--tasks NAME (lm-evaluation-harness), or both")
    chosen = [parse_metric(spec) for spec in dict.fromkeys(metrics or ["exact"])]
    required = _requirements(pass_if or [], [m.name for m in chosen], general, data)
    generator = load_generator(source, checkpoint, force=force, warn=lambda text: say(f"warning: {text}"))
    rows = read_held_out(data, generator.encoder, limit) if data is not None else []
    if generator.precision_note:
        say(generator.precision_note)
    if getattr(generator.model, "disable_adapter", None) is None:
        gains = [r.text for r in required if r.gain]
        if gains:  # before any work: a gain is measured against the base column
            raise UserError(f"--pass-if {gains[0]}: a gain needs the base column, which a whole model has not",
                            hint="use METRIC>=X on a whole model, or evaluate an adapter run")
        say("no base column: this is a whole model, not an adapter on a base (evaluate the base model directory "
            "on its own to compare)")
    report, columns = _held_out_report(generator, data, rows, chosen, general, max_new_tokens, say, progress) \
        if rows else ({}, [])
    if required:
        reasons = [why for why in (r.shortfall(columns) for r in required) if why]
        report["verdict"] = {"passed": not reasons, "pass_if": [r.text for r in required], "reasons": reasons}
        say(("FAIL: " + "; ".join(reasons)) if reasons else f"PASS: {', '.join(r.text for r in required)}")
    if tasks:
        from gpupoor.commands.eval_tasks import render_tasks, run_tasks

        report["tasks"] = run_tasks(generator, tasks, limit, progress)
        say(render_tasks(report["tasks"]))
    target = output or _default_output(source, data)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, json.dumps(report, indent=2) + "\n")
    say(f"wrote {target}")
    return report


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
    columns.append(score_model("tuned", generator, rows, chosen, general_prompts, max_new_tokens, progress))
    report = {"data": str(data), "rows": len(rows), "metrics": [m.name for m in chosen],
              "columns": [{k: v for k, v in asdict(c).items() if k != "answers"} | {
                  "means": {m.name: c.mean(m.name) for m in chosen}} for c in columns],
              "examples": [{"where": row.where, "expected": row.expected,
                            **{c.name: c.answers[i] for c in columns}} for i, row in enumerate(rows)]}
    say(render(report, columns, chosen, rows, general))
    return report, columns


def _requirements(specs: list[str], metrics: list[str], general: bool, data: Path | None) -> list[Requirement]:
    """--pass-if, checked before any work: each names a metric scored (or `general`, with --general)."""
    required = [parse_requirement(spec) for spec in specs]
    for requirement in required:
        if data is None:
            raise UserError(f"--pass-if {requirement.text}: needs --data, the held-out rows it is measured on")
        if requirement.name == "general" and not general:
            raise UserError(f"--pass-if {requirement.text}: add --general, which asks the general questions")
        if requirement.name != "general" and requirement.name not in metrics:
            raise UserError(f"--pass-if {requirement.text}: {requirement.name} is not among the metrics scored "
                            f"({', '.join(metrics)})", hint=f"add --metric {requirement.name}")
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
    if general:
        lines.append(f"{'general questions kept':{width}}" + "".join(
            f"{f'{c.general_kept}/{len(GENERAL)}':>16}" for c in columns))
        for i, (question, word) in enumerate(GENERAL):
            lines.append(f"  {question} (must say {word!r}): " + "; ".join(
                f"{c.name} {c.general[i]!r}" for c in columns))
    first = metrics[0].name
    differing = [i for i in range(len(rows)) if (len({c.answers[i] for c in columns}) > 1 if len(columns) > 1
                                                 else columns[0].scores[first][i] < 1)]
    if differing:
        lines.append(f"first rows where {'the models differ' if len(columns) > 1 else 'the answer is not ' + first}:")
    here = f"{Path.cwd()}/"
    for i in differing[:examples]:
        lines.append(f"  {rows[i].where.removeprefix(here)}: expected {rows[i].expected!r}; " + "; ".join(
            f"{c.name} {c.answers[i]!r}" for c in columns))
    return "\n".join(lines)
