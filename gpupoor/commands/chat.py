"""`gpupoor chat`: talk to a tuned model in the terminal, in the format its run trained on, which decides what a
line is: a chat run's user turn (rendered with its chat template, the answer streamed as it is generated), an
alpaca run's instruction (`/input TEXT` sets the input that goes with it, as the rows had one), a completion or
text run's prompt. A chat run whose rows were single exchanges answers each turn alone, as it trained (`--history`
carries the conversation; a run of multi-turn rows carries it by default); the banner says which. `/system TEXT`
sets a chat run's system prompt and starts over, `/reset` starts over, `/exit` (or end of input) leaves; a command
that does not apply to the run's format says so."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError

COMMANDS = {"/system": "/system TEXT: set the system prompt (and start over)",
            "/input": "/input TEXT: the input that goes with each instruction (/input alone: none)",
            "/reset": "/reset: start over", "/exit": "/exit: leave"}
ROWS_LOOKED_AT = 200  # a chat run's first training rows, read to tell single exchanges from conversations


def commands_for(format_name: str) -> list[str]:
    """The commands that apply to a run of this format."""
    own = {"chat": ["/system"], "alpaca": ["/input"]}.get(format_name, [])
    return own + ["/reset", "/exit"]


def trained_on_conversations(source: Path, checkpoint: str) -> bool | None:
    """Whether a chat run's training rows hold more than one user turn (of the first ROWS_LOOKED_AT of its first
    source); None when that cannot be read (not a run, the data moved)."""
    from gpupoor.data.loading import iter_rows, resolve_source
    from gpupoor.storage.rundir import stored_recipe
    from gpupoor.storage.run_weights import locate_weights

    try:
        run_dir = locate_weights(source, checkpoint).run_dir
        if run_dir is None:
            return None
        data = stored_recipe(run_dir).data
        first = data.sources()[0]
        rows = iter_rows(resolve_source(first.path, run_dir, first.split or "train", "data.path"), ROWS_LOOKED_AT)
        return any(sum(isinstance(m, dict) and m.get("role") == "user" for m in row.fields.get(
            first.messages_field) or []) > 1 for row in rows)
    except (UserError, OSError, IndexError):
        return None


class StdinLines:
    """`read` for chat from a binary stream (standard input's bytes): each line decoded as UTF-8 on its own, so a
    line that is not text (or holds a NUL byte) is a UserError naming `<stdin>:LINE` and the next line reads on.
    (input() decodes with the locale's error handler: strict, it raised and lost the session; in a C/POSIX locale
    the bad bytes reached the tokenizer as lone surrogates, a TypeError.)"""

    def __init__(self, stream, write: Callable[[str], None]):
        self.stream, self.write = stream, write
        self.number = 0  # lines read so far

    def __call__(self, prompt: str) -> str:
        from gpupoor.data.loading import decode_line

        self.write(prompt)
        raw = self.stream.readline()
        if not raw:
            raise EOFError
        self.number += 1
        return decode_line(raw.rstrip(b"\r\n"), f"<stdin>:{self.number}")


def chat(source: Path, checkpoint: str, base: str | None, max_new_tokens: int, temperature: float,
         read: Callable[[str], str], write: Callable[[str], None], force: bool = False,
         warn: Callable[[str], None] = print, history: bool | None = None) -> None:
    """The loop: `read(prompt)` returns a line (EOFError ends), `write` prints without a newline of its own.
    `history`: carry a chat run's conversation (None: as its training rows were)."""
    import torch
    from transformers import TextStreamer

    from gpupoor.model.decoding import decoder_for
    from gpupoor.model.generation import cap_new_tokens, load_generator

    generator = load_generator(source, checkpoint, base, None, force=force, warn=warn)
    model, tokenizer, encoder = generator.model, generator.tokenizer, generator.encoder
    fmt = encoder.format.name
    keeps_history, how = _how_turns_are_read(fmt, source, checkpoint, history, warn)
    allowed = commands_for(fmt)
    computing = f"; {generator.precision_note}" if generator.precision_note else ""
    write(f"chatting with {source} ({how}{computing}); {'   '.join(COMMANDS[c] for c in allowed)}\n")
    system, turns, given_input = None, [], None
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    decoder = decoder_for(model)  # the weights do not change during a chat: read (and merged) once
    draws = torch.Generator(next(model.parameters()).device).manual_seed(0) if temperature > 0 else None
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            write("\n")
            return
        except UserError as exc:  # a line that is not text (StdinLines): said, and the conversation goes on
            write(f"({exc.message}; it was not sent: type it again)\n")
            continue
        if not line:
            continue
        command = line.split()[0] if line.startswith("/") else None
        if command in ("/exit", "/quit"):
            return
        if command in COMMANDS and command not in allowed:
            write(f"({command} does not apply to the {fmt} format this run trained on: " + {
                "/system": "its prompts have no system turn", "/input": "its rows have no input field"}[command]
                + ")\n")
            continue
        if command in ("/reset", "/system"):
            if command == "/system":
                system = line.removeprefix("/system").strip() or None
            turns = []
            write("(started over" + (f"; system prompt: {system}" if system else "") + ")\n")
            continue
        if command == "/input":
            given_input = line.removeprefix("/input").strip() or None
            write(f"(input: {given_input})\n" if given_input else "(no input)\n")
            continue
        if command is not None:
            write(f"unknown command {command}; {'   '.join(COMMANDS[c] for c in allowed)}\n")
            continue
        if fmt == "chat":
            turns = (turns if keeps_history else []) + [{"role": "user", "content": line}]
            messages = ([{"role": "system", "content": system}] if system else []) + turns
            row = {encoder.format.names.messages_field: messages}
        else:
            row = encoder.format.prompt_row(line)
            if given_input is not None:  # alpaca: the instruction's input, as the training rows gave one
                row["input"] = given_input
        ids = encoder.encode_prompt(row, "chat")
        try:
            new_tokens, capped = cap_new_tokens(model, [ids], max_new_tokens)
        except UserError as exc:  # the conversation outgrew the context: the session goes on
            write(f"({exc.message}; /reset starts over)\n")
            turns = turns[:-1]
            continue
        write("model> ")
        answer = _streamed_answer(model, decoder, tokenizer, ids, new_tokens, temperature, draws, streamer)
        if not answer:
            write("(empty answer: the model ended its turn at once)\n")
        if capped:
            write(f"(note: {capped})\n")
        if fmt == "chat":
            turns.append({"role": "assistant", "content": answer})


def _streamed_answer(model, decoder, tokenizer, ids: list[int], new_tokens: int, temperature: float, draws,
                     streamer) -> str:
    """The model's answer to prompt `ids`, streamed as it comes: by the decoding engine where it covers the model
    (gpupoor.model.decoding), else by transformers' generate."""
    import torch

    prompt = torch.tensor([ids], device=next(model.parameters()).device)
    if decoder is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        output = decoder.generate(prompt, torch.ones_like(prompt), new_tokens, tokenizer.eos_token_id, pad,
                                  temperature, draws, streamer=streamer)
    else:
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            output = model.generate(input_ids=prompt, max_new_tokens=new_tokens, streamer=streamer,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                    **sampling)[:, len(ids):]
    return tokenizer.decode(output[0], skip_special_tokens=True).strip()


def _how_turns_are_read(fmt: str, source: Path, checkpoint: str, history: bool | None,
                        warn: Callable[[str], None]) -> tuple[bool, str]:
    """(does a chat run carry the conversation, the banner's words for how a line is read)."""
    if history is not None and fmt != "chat":  # the flag was given for nothing: said rather than ignored
        warn(f"--{'' if history else 'no-'}history has no effect here: the {fmt} run's lines are each answered on "
             "their own (only a chat run carries a conversation)")
    if fmt == "alpaca":
        return False, "alpaca format: each line is an instruction, answered on its own; /input TEXT gives it an input"
    if fmt != "chat":
        return False, f"{fmt} format: each line is a prompt, answered on its own"
    if history is not None:
        return history, "chat template; " + ("the conversation is carried (--history)" if history else
                                             "each turn is answered alone (--no-history)")
    conversations = trained_on_conversations(source, checkpoint)
    if conversations is False:
        return False, ("chat template; each turn is answered alone, as the run's rows were single exchanges "
                       "(--history carries the conversation)")
    return True, "chat template; the conversation is carried" + (
        ", as the run's rows were conversations" if conversations else "") + " (--no-history: each turn alone)"
