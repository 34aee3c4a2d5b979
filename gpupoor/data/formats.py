"""Turn a raw row into token ids and labels: prompt tokens get label -100, completion tokens are trained.

Each format first renders a row into segments of text, each marked trainable or not; segments are
tokenized one by one so the boundary between prompt and completion is exact in token space.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupoor.errors import UserError

IGNORE_INDEX = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)

# Used for `format: chat` when the tokenizer has no chat template (ChatML, as Qwen and many others use).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    if input_text:
        return ALPACA_PROMPT.format(with_input=", paired with an input that provides further context",
                                    instruction=instruction, input_block=f"### Input:\n{input_text}\n\n")
    return ALPACA_PROMPT.format(with_input="", instruction=instruction, input_block="")


def _field(row: dict, name: str, where: str, fmt: str, required: bool = True) -> str:
    value = row.get(name)
    if value is None:
        if not required:
            return ""
        raise UserError(f"{where}: missing field '{name}' (format {fmt} needs it; the row has "
                        f"{', '.join(map(repr, row)) or 'no fields'})")
    if not isinstance(value, str):
        raise UserError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    return value


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_row(row: dict, where: str, fmt: str, text_field: str = "text", messages_field: str = "messages",
              needs_assistant: bool = True) -> None:
    """Raise a UserError naming file:line and the field when a row does not fit the format.

    `needs_assistant`: a chat row must have an assistant turn (training without data.train_on_prompt has
    nothing else to learn from); a prompt for `generate` need not."""
    if fmt == "text":
        _field(row, text_field, where, fmt)
    elif fmt == "alpaca":
        _field(row, "instruction", where, fmt)
        _field(row, "input", where, fmt, required=False)
        _field(row, "output", where, fmt)
    elif fmt == "completion":
        _field(row, "prompt", where, fmt)
        _field(row, "completion", where, fmt)
    else:
        messages = row.get(messages_field)
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: field '{messages_field}' must be a non-empty list of "
                            "{role, content} messages" + ("" if messages_field in row else " (it is missing)"))
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise UserError(f"{where}: {messages_field}[{index}] needs string fields 'role' and 'content'")
            if message["role"] not in CHAT_ROLES:
                raise UserError(f"{where}: {messages_field}[{index}] has role {message['role']!r}; allowed: "
                                f"{', '.join(CHAT_ROLES)}", hint="rename the role (e.g. human -> user, gpt -> "
                                "assistant)")
        first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
        if first is not None and messages[first]["role"] == "assistant":
            raise UserError(f"{where}: {messages_field}[{first}] is an assistant turn before any user turn; after "
                            "optional system turns a conversation starts with the user",
                            hint="add the user turn it answers, or drop the row")
        if needs_assistant and not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where}: {messages_field} has no assistant turn, so there is nothing to train on",
                            hint="add the assistant's reply, or set data.train_on_prompt: true to train on the "
                            "whole conversation")


class Encoder:
    """Row -> Encoded, for one format, tokenizer and max_length."""

    def __init__(self, tokenizer, fmt: str, max_length: int, train_on_prompt: bool = False,
                 text_field: str = "text", messages_field: str = "messages", chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_length = max_length
        self.train_on_prompt = train_on_prompt
        self.text_field = text_field
        self.messages_field = messages_field
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        self.template_name = ("data.chat_template" if chat_template else "the tokenizer's chat template"
                              if getattr(tokenizer, "chat_template", None) else "the default ChatML template")
        bos = tokenizer.bos_token_id
        # Add BOS only where the tokenizer itself would (Llama yes, Qwen no).
        self.bos = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []
        if tokenizer.eos_token_id is None:
            raise UserError("the tokenizer has no EOS token; gpupoor appends EOS so the model learns to stop")
        self.eos = tokenizer.eos_token_id

    def segments(self, row: dict, where: str) -> list[tuple[str, bool]]:
        """The row as (text, trainable) pieces; EOS handling is done by encode()."""
        if self.fmt == "text":
            return [(_field(row, self.text_field, where, "text"), True)]
        if self.fmt == "alpaca":
            prompt = alpaca_prompt(_field(row, "instruction", where, "alpaca"),
                                   _field(row, "input", where, "alpaca", required=False))
            return [(prompt, False), (_field(row, "output", where, "alpaca"), True)]
        if self.fmt == "completion":
            return [(_field(row, "prompt", where, "completion"), False),
                    (_field(row, "completion", where, "completion"), True)]
        return self._chat_segments(row, where)

    def _render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.chat_template,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template is user code: jinja2 errors, raise_exception(), TypeError...
            raise UserError(f"{where}: {self.template_name} failed on this row ({len(messages)} messages, "
                            f"add_generation_prompt={generation_prompt}): {type(exc).__name__}: {exc}",
                            hint="fix the template, or the row if the template rejects it on purpose") from None

    def _chat_segments(self, row: dict, where: str) -> list[tuple[str, bool]]:
        check_row(row, where, "chat", messages_field=self.messages_field, needs_assistant=not self.train_on_prompt)
        messages = row[self.messages_field]
        # Render prefix by prefix: the text an assistant turn adds is its completion; the generation
        # prompt before it (e.g. "<|im_start|>assistant\n") stays a prompt.
        pieces: list[tuple[str, bool]] = []
        rendered = ""
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                before = self._render(messages[:index], generation_prompt=True, where=where)
                after = self._render(messages[: index + 1], generation_prompt=False, where=where)
                self._check_prefix(rendered, before, where)
                self._check_prefix(before, after, where)
                pieces += [(before[len(rendered):], False), (after[len(before):], True)]
            else:
                after = self._render(messages[: index + 1], generation_prompt=False, where=where)
                self._check_prefix(rendered, after, where)
                pieces.append((after[len(rendered):], False))
            rendered = after
        return [(text, trainable) for text, trainable in pieces if text]

    @staticmethod
    def _check_prefix(prefix: str, text: str, where: str) -> None:
        if not text.startswith(prefix):
            raise UserError(f"{where}: the chat template re-renders earlier turns differently as the "
                            "conversation grows, so assistant turns cannot be located",
                            hint="set data.chat_template to a template whose output only grows, or "
                            "data.train_on_prompt: true")

    def prompt_segments(self, row: dict, where: str) -> list[tuple[str, bool]]:
        """The prompt of a row as training rendered it, ending where the model's answer starts."""
        if self.fmt == "text":
            return [(_field(row, self.text_field, where, "text"), False)]
        if self.fmt == "alpaca":
            return [(alpaca_prompt(_field(row, "instruction", where, "alpaca"),
                                   _field(row, "input", where, "alpaca", required=False)), False)]
        if self.fmt == "completion":
            return [(_field(row, "prompt", where, "completion"), False)]
        check_row(row, where, "chat", messages_field=self.messages_field, needs_assistant=False)
        return [(self._render(row[self.messages_field], generation_prompt=True, where=where), False)]

    def encode_prompt(self, row: dict, where: str) -> list[int]:
        """Token ids of the prompt, tokenized exactly as in training (same BOS rule, same segments)."""
        return self._tokenize(self.prompt_segments(row, where))[0]

    def _tokenize(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int], list[int]]:
        """(ids, labels, ids of the last trainable segment)."""
        ids: list[int] = list(self.bos)
        labels: list[int] = [IGNORE_INDEX] * len(ids)
        last_completion: list[int] = []
        for text, trainable in segments:
            if self.bos and not ids[len(self.bos):] and text.startswith(self.tokenizer.bos_token or "\0"):
                ids, labels = [], []  # the chat template already writes BOS
            piece = self.tokenizer(text, add_special_tokens=False).input_ids
            ids += piece
            labels += piece if (trainable or self.train_on_prompt) else [IGNORE_INDEX] * len(piece)
            if trainable:
                last_completion = piece
        return ids, labels, last_completion

    def encode(self, row: dict, where: str) -> Encoded:
        segments = self.segments(row, where)
        ids, labels, last_completion = self._tokenize(segments)
        # A chat template may end each turn with EOS itself (Qwen's <|im_end|>); otherwise append it.
        if self.eos not in last_completion:
            ids.append(self.eos)
            labels.append(self.eos)  # trained, so the model learns to stop
        truncated = len(ids) > self.max_length
        return Encoded(ids[: self.max_length], labels[: self.max_length], truncated)
