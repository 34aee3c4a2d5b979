"""`gpupoor chat`: talk to a tuned model in the terminal, in the format its run trained on. A chat-format run keeps
the conversation (rendered with its chat template each turn, the answer streamed as it is generated); a run of
another format (alpaca, text, completion) answers each message on its own. `/system TEXT` sets a system prompt
and starts over, `/reset` starts over, `/exit` (or end of input) leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError

HELP = "/system TEXT: set the system prompt (and start over)   /reset: start over   /exit: leave"


class StdinLines:
    """`read` for chat from a binary stream (standard input's bytes): each line decoded as UTF-8 on its own, so a
    line that is not text (or holds a NUL byte) is a UserError naming `<stdin>:LINE` and the next line reads on.
    (input() decodes with the locale's error handler: strict, it raised and lost the session; in a C/POSIX locale
    the bad bytes reached the tokenizer as lone surrogates, a TypeError.)"""

    def __init__(self, stream, write: Callable[[str], None]):
        self.stream, self.write = stream, write
        self.number = 0  # lines read so far

    def __call__(self, prompt: str) -> str:
        from gpupoor.commands.generate import decode_line

        self.write(prompt)
        raw = self.stream.readline()
        if not raw:
            raise EOFError
        self.number += 1
        return decode_line(raw.rstrip(b"\r\n"), f"<stdin>:{self.number}")


def chat(source: Path, checkpoint: str, base: str | None, max_new_tokens: int, temperature: float,
         read: Callable[[str], str], write: Callable[[str], None], force: bool = False,
         warn: Callable[[str], None] = print) -> None:
    """The loop: `read(prompt)` returns a line (EOFError ends), `write` prints without a newline of its own."""
    import torch
    from transformers import TextStreamer

    from gpupoor.commands.generate import cap_new_tokens, load_generator

    generator = load_generator(source, checkpoint, base, None, force=force, warn=warn)
    model, tokenizer, encoder = generator.model, generator.tokenizer, generator.encoder
    keeps_history = encoder.format.name == "chat"
    how = "chat template" if keeps_history else f"{encoder.format.name} format: each message is answered on its own"
    computing = f"; {generator.precision_note}" if generator.precision_note else ""
    write(f"chatting with {source} ({how}{computing}); {HELP}\n")
    system, history = None, []
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
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
        if line in ("/exit", "/quit"):
            return
        if line == "/reset" or line.startswith("/system"):
            if line.startswith("/system"):
                system = line.removeprefix("/system").strip() or None
            history = []
            write("(started over" + (f"; system prompt: {system}" if system else "") + ")\n")
            continue
        if line.startswith("/"):
            write(f"unknown command {line.split()[0]}; {HELP}\n")
            continue
        if keeps_history:
            history.append({"role": "user", "content": line})
            messages = ([{"role": "system", "content": system}] if system else []) + history
            row = {encoder.format.names.messages_field: messages}
        else:
            row = encoder.format.prompt_row(line)
        ids = encoder.encode_prompt(row, "chat")
        try:
            new_tokens, capped = cap_new_tokens(model, [ids], max_new_tokens)
        except UserError as exc:  # the conversation outgrew the context: the session goes on
            write(f"({exc.message}; /reset starts over)\n")
            history = history[:-1]
            continue
        write("model> ")
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            output = model.generate(input_ids=torch.tensor([ids], device=next(model.parameters()).device),
                                    max_new_tokens=new_tokens, streamer=streamer,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                    **sampling)
        answer = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True).strip()
        if not answer:
            write("(empty answer: the model ended its turn at once)\n")
        if capped:
            write(f"(note: {capped})\n")
        if keeps_history:
            history.append({"role": "assistant", "content": answer})
