"""`gpupoor generate`: try a trained model in one command, with the prompt format the run trained on: the prompts
from --prompt, a file or standard input, answered by gpupoor.model.generation."""

from __future__ import annotations

import json
from pathlib import Path

from gpupoor.data.loading import decode_line
from gpupoor.errors import UserError
from gpupoor.model.generation import cap_new_tokens, complete, load_generator


def prompt_row(text: str, encoder) -> dict:
    """A row of the run's format (the encoder's, with its field names) holding one user prompt."""
    return encoder.format.prompt_row(text)


def rows_from_file(path: Path, encoder) -> list[tuple[dict, str]]:
    """(row, where) per JSONL line: rows in the run's format, or {"prompt": "..."}. A chat row's trailing
    assistant turn (the expected answer) is dropped so the model writes its own."""
    from gpupoor.data.loading import read_rows, resolve_source

    return _prompt_rows(read_rows(resolve_source(str(path), Path.cwd(), "train", "--file")), encoder)


def _prompt_rows(rows, encoder) -> list[tuple[dict, str]]:
    """(row, where) for each data row (gpupoor.data.loading.Row) of a prompts file, as rows_from_file says."""
    from gpupoor.data.row_fields import wrong_type

    data_format = encoder.format
    prompts = []
    for row in rows:
        fields = dict(row.fields)
        if "prompt" in fields and isinstance(fields["prompt"], str):
            fields = data_format.prompt_row(fields["prompt"])
        elif "prompt" in fields and not data_format.has_prompt_field:  # (theirs: checked as rows)
            raise wrong_type(row.where, "prompt", fields["prompt"])
        else:
            fields = data_format.as_prompt(fields)
        prompts.append((fields, row.where))
    return prompts


def check_sampling(temperature: float) -> None:
    """generate's and chat's --temperature: a finite number (typer's min=0 lets inf through: a division of the
    logits by it gives NaN probabilities, and torch's sampler fails after the model has loaded)."""
    import math

    if not math.isfinite(temperature):
        raise UserError(f"--temperature {temperature}: give a finite number, 0 (greedy) or e.g. 0.7")


def check_prompt_source(prompt: str | None, file: Path | None) -> None:
    """At most one of --prompt and --file; neither reads standard input, which must then be piped. A prompt has
    something in it (an empty one renders the format's bare frame, which the model answers with anything)."""
    import sys

    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty: give the text to answer (the instruction, user turn or text)")
    if prompt is not None and file is not None:
        raise UserError("give one of --prompt TEXT or --file PROMPTS.jsonl, not both")
    if prompt is None and file is None and sys.stdin.isatty():
        raise UserError("no prompt: give --prompt TEXT, --file PROMPTS.jsonl, or pipe prompts in (one per line, or "
                        "JSONL rows)")


def rows_from_stdin(encoder) -> list[tuple[dict, str]]:
    """Standard input as JSONL rows (as --file reads them) when every line is a JSON object, else one prompt per
    non-empty line. Errors name `<stdin>:LINE`."""
    from gpupoor.data.loading import jsonl_rows

    lines = stdin_lines()
    texts = [(number, line) for number, line in lines if line.strip()]

    def is_row(line: str) -> bool:
        try:
            return isinstance(json.loads(line), dict)
        except ValueError:
            return False

    if texts and all(is_row(line) for _, line in texts):
        return _prompt_rows(jsonl_rows(lines, "<stdin>"), encoder)
    return [(prompt_row(line, encoder), f"<stdin>:{number}") for number, line in texts]


def stdin_lines() -> list[tuple[int, str]]:
    """Standard input's lines as (number, text), each decoded as UTF-8 on its own (decode_line): Python's own
    decoding either fails on the whole input, naming no line, or (in a C/POSIX locale) lets the bad bytes through
    as lone surrogates that the tokenizer then rejects with a TypeError."""
    import sys

    stream = getattr(sys.stdin, "buffer", None)  # (a program that swapped sys.stdin for text has no bytes)
    raw = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogatepass")
    return [(number, decode_line(line, f"<stdin>:{number}")) for number, line in enumerate(raw.splitlines(), 1)]


def answer_prompts(source: Path, checkpoint: str, base: str | None, fmt: str | None, prompt: str | None,
                   file: Path | None, max_new_tokens: int, temperature: float, out, note, force: bool = False,
                   warn=print) -> None:
    """`gpupoor generate`: the answer to --prompt, or one JSON line per row of --file (or standard input); an
    empty answer gets a note saying why."""
    generator = load_generator(source, checkpoint, base, fmt, force=force, warn=warn)
    encoder = generator.encoder
    if prompt is not None:
        rows = [(prompt_row(prompt, encoder), "--prompt")]
    elif file is None or str(file) == "-":
        rows = rows_from_stdin(encoder)
    else:
        rows = rows_from_file(file, encoder)
    prompts = [encoder.encode_prompt(row, where) for row, where in rows]
    if not prompts and file is None:
        raise UserError("no prompt: standard input was empty",
                        hint="give --prompt TEXT, --file PROMPTS.jsonl, or pipe prompts in (one per line, or JSONL rows)")
    if not prompts:
        raise UserError(f"--file {file}: no prompts in it")
    if generator.precision_note:
        note(generator.precision_note)
    new_tokens, capped = cap_new_tokens(generator.model, prompts, max_new_tokens)
    if capped:
        note(capped)
    reasons: list[str | None] = []
    answers = complete(generator.model, generator.tokenizer, prompts, new_tokens, temperature, reasons=reasons)
    for (row, where), answer, reason in zip(rows, answers, reasons):
        if reason:
            note(f"{where}: empty answer: {reason}")
        out(answer if prompt is not None else json.dumps({**row, "completion": answer}))
