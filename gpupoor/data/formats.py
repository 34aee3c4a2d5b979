"""Turn a raw row into token ids and labels: prompt tokens get label -100, completion tokens are trained.

Each text format first renders a row into segments of text, each marked trainable or not; segments are
tokenized one by one so the boundary between prompt and completion is exact in token space. `chat` and
`sharegpt` rows are conversations rendered with a chat template; `tokenized` rows bring their own ids and labels.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

from gpupoor.data.templates import TEMPLATES, missing_template_error, resolve_chat_template
from gpupoor.errors import UserError
from gpupoor.recipe.schema import SHAREGPT_ROLES

IGNORE_INDEX = -100
CHAT_FORMATS = ("chat", "sharegpt")  # rendered with a chat template

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    # Where each sequence after the first starts: a `preference` pair is its chosen sequence (prompt + chosen
    # answer), then its rejected one, stored as one example so that nothing can split it.
    sequence_starts: tuple[int, ...] = ()


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    if input_text:
        return ALPACA_PROMPT.format(with_input=", paired with an input that provides further context",
                                    instruction=instruction, input_block=f"### Input:\n{input_text}\n\n")
    return ALPACA_PROMPT.format(with_input="", instruction=instruction, input_block="")


def _json_type(value) -> str:
    """What a JSON value is, in JSON's words (an error says `null`, not `None`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Number):
        return "a number"
    return {str: "a string", list: "a list", tuple: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def wrong_type(where: str, name: str, value, expected: str = "a string") -> UserError:
    """A field that is there but holds the wrong kind of value (null included): not a *missing* field."""
    shown = f" ({json.dumps(value)[:40]})" if isinstance(value, (bool, numbers.Number)) else ""
    return UserError(f"{where}: field '{name}' is {_json_type(value)}{shown}, expected {expected}")


def _field(row: dict, name: str, where: str, fmt: str, required: bool = True) -> str:
    value = row.get(name)
    if value is None and (name not in row or not required):  # an optional field may be null (a parquet gap)
        if not required:
            return ""
        raise UserError(f"{where}: missing field '{name}' (format {fmt} needs it; the row has "
                        f"{', '.join(map(repr, row)) or 'no fields'})")
    if not isinstance(value, str):
        raise wrong_type(where, name, value)
    return value


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_messages(row: dict, where: str, messages_field: str = "messages", needs_assistant: bool = True) -> list[dict]:
    """The {role, content} messages of a `chat` row, checked."""
    messages = row.get(messages_field)
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: field '{messages_field}' must be a non-empty list of "
                        "{role, content} messages" + ("" if messages_field in row else " (it is missing)"))
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UserError(f"{where}: {messages_field}[{index}] needs string fields 'role' and 'content'")
    _check_turns(messages, where, messages_field, needs_assistant)
    return messages


def sharegpt_messages(row: dict, where: str, conversations_field: str = "conversations",
                      roles: dict[str, str] | None = None, needs_assistant: bool = True) -> list[dict]:
    """The turns of a `sharegpt` row ({from, value}) as {role, content} messages, `from` mapped by `roles`
    (data.sharegpt_roles), then checked like a chat row. Turn i stays message i, so errors name the row's index."""
    roles = SHAREGPT_ROLES if roles is None else roles
    turns = row.get(conversations_field)
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: field '{conversations_field}' must be a non-empty list of {{from, value}} turns"
                        + ("" if conversations_field in row else " (it is missing)"))
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) \
                or not isinstance(turn.get("value"), str):
            raise UserError(f"{where}: {conversations_field}[{index}] needs string fields 'from' and 'value'")
        role = roles.get(turn["from"])
        if role is None:
            raise UserError(f"{where}: {conversations_field}[{index}] has from {turn['from']!r}, which "
                            f"data.sharegpt_roles does not map; known: {', '.join(roles) or 'none'}",
                            hint=f"add it to data.sharegpt_roles (e.g. `{turn['from']}: user`; the roles are "
                            f"{', '.join(CHAT_ROLES)}), or fix the row")
        messages.append({"role": role, "content": turn["value"]})
    _check_turns(messages, where, conversations_field, needs_assistant)
    return messages


def _check_turns(messages: list[dict], where: str, field: str, needs_assistant: bool) -> None:
    for index, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise UserError(f"{where}: {field}[{index}] has role {message['role']!r}; allowed: "
                            f"{', '.join(CHAT_ROLES)}", hint="rename the role (e.g. human -> user, gpt -> "
                            "assistant)")
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is not None and messages[first]["role"] == "assistant":
        raise UserError(f"{where}: {field}[{first}] is an assistant turn before any user turn; after "
                        "optional system turns a conversation starts with the user",
                        hint="add the user turn it answers, or drop the row")
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: {field} has no assistant turn, so there is nothing to train on",
                        hint="add the assistant's reply, or set data.train_on_prompt: true to train on the "
                        "whole conversation")


PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


def preference_parts(row: dict, where: str) -> tuple[str | list[dict], str | list[dict], str | list[dict]]:
    """(prompt, chosen, rejected) of a `preference` row, checked: three strings, or message lists (TRL's
    conversational format). Without `prompt`, chosen and rejected are whole conversations and the messages they
    share from the start are the prompt (TRL's implicit prompt)."""
    missing = [name for name in ("chosen", "rejected") if name not in row]
    if missing:
        raise UserError(f"{where}: missing field '{missing[0]}' (format preference needs prompt, chosen and rejected; "
                        f"the row has {', '.join(map(repr, row)) or 'no fields'})")
    for name in ("chosen", "rejected"):
        if row[name] is None:
            raise wrong_type(where, name, None, "a string or a list of messages")
    if isinstance(row["chosen"], str) or isinstance(row["rejected"], str):
        return tuple(_field(row, name, where, "preference") for name in PREFERENCE_FIELDS)
    if row.get("prompt") is None:
        chosen = chat_messages(row, where, "chosen")
        rejected = chat_messages(row, where, "rejected")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0 or shared in (len(chosen), len(rejected)):
            raise UserError(f"{where}: without a 'prompt' field, chosen and rejected must be conversations that "
                            "share their first messages (the prompt) and differ after them (the answers)",
                            hint="add a 'prompt' field (a string, or a list of messages), or fix the row")
        parts = (chosen[:shared], chosen[shared:], rejected[shared:])
    else:
        if not isinstance(row["prompt"], list):
            raise UserError(f"{where}: field 'prompt' must be a list of messages when chosen and rejected are "
                            f"(it is {type(row['prompt']).__name__})", hint="give all three as strings or all "
                            "three as {role, content} message lists")
        parts = (chat_messages(row, where, "prompt", needs_assistant=False), _answer(row, where, "chosen"),
                 _answer(row, where, "rejected"))
    for name, answer in zip(("chosen", "rejected"), parts[1:]):
        if not any(message["role"] == "assistant" for message in answer):
            raise UserError(f"{where}: the {name} answer has no assistant message, so there is nothing to compare",
                            hint="an answer is one or more messages with role assistant")
    return parts


def _answer(row: dict, where: str, name: str) -> list[dict]:
    """A chosen or rejected answer given as messages (usually one, role assistant), each checked."""
    messages = row[name]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: field '{name}' must be a string or a non-empty list of {{role, content}} messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UserError(f"{where}: {name}[{index}] needs string fields 'role' and 'content'")
        if message["role"] not in CHAT_ROLES:
            raise UserError(f"{where}: {name}[{index}] has role {message['role']!r}; allowed: {', '.join(CHAT_ROLES)}")
    return messages


def _int_list(row: dict, name: str, where: str, allow_bool: bool = False) -> list[int]:
    values = row.get(name)
    if not isinstance(values, (list, tuple)):
        raise UserError(f"{where}: field '{name}' must be a list of integers, got {type(values).__name__}")
    for index, value in enumerate(values):
        # bool is an int in Python: True as a token id is a data bug, as a 0/1 mask it is fine.
        if not isinstance(value, numbers.Integral) or (isinstance(value, bool) and not allow_bool):
            raise UserError(f"{where}: {name}[{index}] is {value!r} ({type(value).__name__}), not an integer")
    return [int(value) for value in values]


def tokenized_example(row: dict, where: str, vocab_size: int | None = None) -> tuple[list[int], list[bool]]:
    """A `tokenized` row's input_ids and which of them are trained (from `labels`, -100 where not trained, or a
    0/1 `loss_mask`), checked. `vocab_size`: len(tokenizer), when a tokenizer is at hand."""
    if not isinstance(row.get("input_ids"), (list, tuple)) or not row["input_ids"]:
        raise UserError(f"{where}: format tokenized needs a non-empty list 'input_ids' (the row has "
                        f"{', '.join(map(repr, row)) or 'no fields'})")
    ids = _int_list(row, "input_ids", where)
    has_labels, has_mask = row.get("labels") is not None, row.get("loss_mask") is not None
    if not has_labels and not has_mask:
        raise UserError(f"{where}: format tokenized needs 'labels' (the id where trained, -100 elsewhere) or "
                        f"'loss_mask' (1 where trained, 0 elsewhere) beside 'input_ids'; the row has "
                        f"{', '.join(map(repr, row))}")
    trained = _trained_from_labels(ids, _int_list(row, "labels", where), where) if has_labels else None
    if has_mask:
        from_mask = _trained_from_mask(ids, _int_list(row, "loss_mask", where, allow_bool=True), where)
        if trained is not None and from_mask != trained:
            first = next(i for i, keep in enumerate(from_mask) if keep != trained[i])
            raise UserError(f"{where}: 'labels' and 'loss_mask' disagree at token {first}",
                            hint="keep one of them")
        trained = from_mask
    if vocab_size is not None:
        bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise UserError(f"{where}: input_ids[{bad}] = {ids[bad]} is not a token of this tokenizer (ids 0 to "
                            f"{vocab_size - 1}: len(tokenizer) = {vocab_size})",
                            hint="tokenize the rows with the model's own tokenizer; the model's embedding may have "
                            "more rows than the tokenizer has tokens (padded to a multiple of 64 or 128), but ids "
                            "past len(tokenizer) are not tokens of it")
    return ids, trained


def _same_length(ids: list[int], other: list[int], name: str, where: str) -> None:
    if len(other) != len(ids):
        raise UserError(f"{where}: '{name}' has {len(other)} entries but 'input_ids' has {len(ids)}; they need one "
                        "per token")


def _trained_from_mask(ids: list[int], mask: list[int], where: str) -> list[bool]:
    _same_length(ids, mask, "loss_mask", where)
    bad = next((i for i, m in enumerate(mask) if m not in (0, 1)), None)
    if bad is not None:
        raise UserError(f"{where}: loss_mask[{bad}] is {mask[bad]}; a loss mask holds 0 or 1 per token")
    return [bool(m) for m in mask]


def _trained_from_labels(ids: list[int], labels: list[int], where: str) -> list[bool]:
    _same_length(ids, labels, "labels", where)
    for index, (token, label) in enumerate(zip(ids, labels)):
        # gpupoor stores which tokens are trained, not the labels: a label is the token itself (transformers
        # shifts inside the model), so any other value would be silently replaced by the input token.
        if label != IGNORE_INDEX and label != token:
            raise UserError(f"{where}: labels[{index}] = {label} but input_ids[{index}] = {token}: a label is "
                            f"either the token at the same position or {IGNORE_INDEX}",
                            hint="labels are not shifted (the model shifts them); give a 0/1 'loss_mask' instead "
                            "if that is easier")
    return [label != IGNORE_INDEX for label in labels]


def check_row(row: dict, where: str, fmt: str, text_field: str = "text", messages_field: str = "messages",
              needs_assistant: bool = True, *, conversations_field: str = "conversations",
              sharegpt_roles: dict[str, str] | None = None) -> None:
    """Raise a UserError naming file:line and the field when a row does not fit the format.

    `needs_assistant`: a chat row must have an assistant turn (training without data.train_on_prompt has
    nothing else to learn from); a prompt for `generate` need not. A tokenized row's ids are checked against
    the vocabulary only by the Encoder, which has the tokenizer."""
    if fmt == "text":
        _field(row, text_field, where, fmt)
    elif fmt == "alpaca":
        _field(row, "instruction", where, fmt)
        _field(row, "input", where, fmt, required=False)
        _field(row, "output", where, fmt)
    elif fmt == "completion":
        _field(row, "prompt", where, fmt)
        _field(row, "completion", where, fmt)
    elif fmt == "tokenized":
        tokenized_example(row, where)
    elif fmt == "sharegpt":
        sharegpt_messages(row, where, conversations_field, sharegpt_roles, needs_assistant)
    elif fmt == "preference":
        preference_parts(row, where)
    else:
        chat_messages(row, where, messages_field, needs_assistant)


class _NotGrowing(Exception):
    """The template renders an earlier turn differently once later turns follow."""


class Encoder:
    """Row -> Encoded, for one format, tokenizer and max_length."""

    def __init__(self, tokenizer, fmt: str, max_length: int, train_on_prompt: bool = False,
                 text_field: str = "text", messages_field: str = "messages", chat_template: str | None = None,
                 conversations_field: str = "conversations", sharegpt_roles: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_length = max_length
        self.train_on_prompt = train_on_prompt
        self.text_field = text_field
        self.messages_field = messages_field
        self.conversations_field = conversations_field
        self.sharegpt_roles = dict(SHAREGPT_ROLES if sharegpt_roles is None else sharegpt_roles)
        # A template name becomes its shipped text, so the cache key follows the text, not the name.
        own = getattr(tokenizer, "chat_template", None)
        self.chat_template = resolve_chat_template(chat_template) or own
        if fmt in CHAT_FORMATS and self.chat_template is None:
            raise missing_template_error("the tokenizer", fmt)
        self.template_name = (f"data.chat_template ({chat_template})" if chat_template in TEMPLATES
                              else "data.chat_template" if chat_template else "the tokenizer's chat template")
        self.vocab_size = len(tokenizer)  # not the model's embedding rows, which may be padded past it
        bos = tokenizer.bos_token_id
        # Add BOS only where the tokenizer itself would (Llama yes, Qwen no).
        self.bos = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []
        if tokenizer.eos_token_id is None and fmt != "tokenized":
            raise UserError("the tokenizer has no EOS token; gpupoor appends EOS so the model learns to stop")
        self.eos = tokenizer.eos_token_id

    def cache_settings(self) -> dict:
        """Every setting that changes what encode() returns for a row (for a tokenization cache key)."""
        chat = self.fmt in CHAT_FORMATS or self.fmt == "preference"  # (pairs of message lists are rendered)
        return {"format": self.fmt, "max_length": self.max_length, "train_on_prompt": self.train_on_prompt,
                "text_field": self.text_field, "messages_field": self.messages_field,
                "conversations_field": self.conversations_field if self.fmt == "sharegpt" else None,
                "sharegpt_roles": self.sharegpt_roles if self.fmt == "sharegpt" else None,
                "template": self.chat_template if chat else None}

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
        if self.fmt == "tokenized":
            raise UserError(f"{where}: a tokenized row holds token ids, not text to render",
                            hint="use a text format (text, alpaca, chat, sharegpt, completion) for prompts")
        if self.fmt == "preference":
            raise ValueError("a preference row is two sequences: Encoder.encode renders it")
        return self._chat_segments(self.messages(row, where, needs_assistant=not self.train_on_prompt), where)

    def messages(self, row: dict, where: str, needs_assistant: bool = True) -> list[dict]:
        """A chat or sharegpt row as checked {role, content} messages."""
        if self.fmt == "sharegpt":
            return sharegpt_messages(row, where, self.conversations_field, self.sharegpt_roles, needs_assistant)
        return chat_messages(row, where, self.messages_field, needs_assistant)

    def _render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.chat_template,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template is user code: jinja2 errors, raise_exception(), TypeError...
            raise UserError(f"{where}: {self.template_name} failed on this row ({len(messages)} messages, "
                            f"add_generation_prompt={generation_prompt}): {type(exc).__name__}: {exc}",
                            hint="fix the template, or the row if the template rejects it on purpose") from None

    def _chat_segments(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        # Render prefix by prefix: the text an assistant turn adds is its completion; the generation
        # prompt before it (e.g. "<|im_start|>assistant\n") stays a prompt.
        boundaries: list[tuple[str, bool]] = []  # (the conversation rendered up to here, is the last stretch trained)
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                boundaries.append((self._render(messages[:index], True, where), False))
            boundaries.append((self._render(messages[: index + 1], False, where), message["role"] == "assistant"))
        try:
            texts = self._growing([text for text, _ in boundaries])
        except _NotGrowing:
            return self._located_segments(messages, where)
        pieces, rendered = [], ""
        for text, (_, trainable) in zip(texts, boundaries):
            pieces.append((text[len(rendered):], trainable))
            rendered = text
        return [(text, trainable) for text, trainable in pieces if text]

    def _growing(self, texts: list[str]) -> list[str]:
        """Each rendering a prefix of the next. A template may close the whole conversation with EOS (Phi-3:
        `{% else %}{{ eos_token }}`): that EOS belongs to the last rendering only, so it is cut from earlier
        ones. Walking backwards lets a cut reach renderings that ended the same way."""
        eos = self.tokenizer.eos_token or ""
        texts = list(texts)
        for index in range(len(texts) - 2, -1, -1):
            text, following = texts[index], texts[index + 1]
            if following.startswith(text):
                continue
            if eos and text.endswith(eos) and following.startswith(text[: -len(eos)]):
                texts[index] = text[: -len(eos)]
                continue
            raise _NotGrowing
        return texts

    def _located_segments(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """For a template that moves text as the conversation grows (Mistral's puts the system prompt in the
        last user turn): render the whole conversation once and find each assistant reply in it, in order, as
        the template renders that reply when it is the last turn. Where the full rendering starts with the
        text before the reply, the reply's place is exact; otherwise it is the next occurrence."""
        full = self._render(messages, False, where)
        eos = self.tokenizer.eos_token or ""
        pieces, cursor = [], 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:index], True, where)
            after = self._render(messages[: index + 1], False, where)
            if not after.startswith(before):
                raise self._not_locatable(where)
            reply = after[len(before):]
            if eos and reply.endswith(eos) and reply not in full[cursor:]:
                reply = reply[: -len(eos)]  # an EOS that only closes the conversation, as in _growing
            exact = len(before) >= cursor and full.startswith(before + reply)
            start = len(before) if exact else full.find(reply, cursor)
            if start < 0 or not reply:
                raise self._not_locatable(where)
            pieces += [(full[cursor:start], False), (reply, True)]
            cursor = start + len(reply)
        pieces.append((full[cursor:], False))
        return [(text, trainable) for text, trainable in pieces if text]

    @staticmethod
    def _not_locatable(where: str) -> UserError:
        return UserError(f"{where}: the chat template re-renders earlier turns differently as the "
                         "conversation grows, so assistant turns cannot be located",
                         hint="set data.chat_template to a template whose output only grows, or "
                         "data.train_on_prompt: true")

    def prompt_segments(self, row: dict, where: str) -> list[tuple[str, bool]]:
        """The prompt of a row as training rendered it, ending where the model's answer starts. A chat row's
        trailing assistant turns (the expected answer) are left out."""
        if self.fmt == "text":
            return [(_field(row, self.text_field, where, "text"), False)]
        if self.fmt == "alpaca":
            return [(alpaca_prompt(_field(row, "instruction", where, "alpaca"),
                                   _field(row, "input", where, "alpaca", required=False)), False)]
        if self.fmt == "completion":
            return [(_field(row, "prompt", where, "completion"), False)]
        if self.fmt == "tokenized":
            raise UserError(f"{where}: a tokenized row holds token ids, not a prompt to render",
                            hint="give prompts in a text format (e.g. generate --format text)")
        if self.fmt == "preference":  # the prompt alone (a prompts file), or a pair's
            if isinstance(row.get("prompt"), str):
                return [(row["prompt"], False)]
            messages = chat_messages(row, where, "prompt", needs_assistant=False) if row.get("prompt") is not None \
                else preference_parts(row, where)[0]
            return [(self._render(messages, True, where), False)]
        messages = list(self.messages(row, where, needs_assistant=False))
        while len(messages) > 1 and messages[-1]["role"] == "assistant":
            messages.pop()
        return [(self._render(messages, generation_prompt=True, where=where), False)]

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
        if self.fmt == "tokenized":
            return self._encode_tokenized(row, where)
        if self.fmt == "preference":
            return self._encode_pair(row, where)
        ids, labels = self._with_eos(*self._tokenize(self.segments(row, where)))
        truncated = len(ids) > self.max_length
        return Encoded(ids[: self.max_length], labels[: self.max_length], truncated)

    def _with_eos(self, ids: list[int], labels: list[int], last_completion: list[int]) -> tuple[list[int], list[int]]:
        # A chat template may end each turn with EOS itself (Qwen's <|im_end|>), or the conversation (Phi-3);
        # otherwise append it.
        if self.eos not in last_completion and ids[-1:] != [self.eos]:
            ids.append(self.eos)
            labels.append(self.eos)  # trained, so the model learns to stop
        return ids, labels

    def _encode_pair(self, row: dict, where: str) -> Encoded:
        """A preference row as one example: the chosen sequence (prompt + chosen answer, EOS), then the rejected
        one; labels on the answers only. Truncation keeps each sequence within max_length: the prompt keeps its
        end, the answers their start (see _truncate_pair)."""
        prompt, chosen, rejected = preference_parts(row, where)
        sequences = [self._with_eos(*self._tokenize(self._pair_segments(prompt, answer, where)))
                     for answer in (chosen, rejected)]
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels), truncated = self._truncate_pair(sequences)
        return Encoded(chosen_ids + rejected_ids, chosen_labels + rejected_labels, truncated, (len(chosen_ids),))

    def _pair_segments(self, prompt, answer, where: str) -> list[tuple[str, bool]]:
        if isinstance(prompt, str):
            return [(prompt, False), (answer, True)]
        if self.chat_template is None:
            raise missing_template_error("the tokenizer", "preference (with message lists)")
        segments = self._chat_segments(prompt + answer, where)
        # Assistant turns inside the prompt are context, not the answer: only the answer's turns are trained.
        context = sum(message["role"] == "assistant" for message in prompt)
        marked = []
        for text, trainable in segments:
            if trainable and context:
                context, trainable = context - 1, False
            marked.append((text, trainable))
        return marked

    def _truncate_pair(self, sequences: list[tuple[list[int], list[int]]]) -> tuple[tuple, tuple, bool]:
        """Each sequence cut to max_length: the prompt (the tokens before the first trained one) keeps its end
        (and a leading BOS), at least half of max_length when it is that long, and no more than the longer answer
        leaves; then each answer keeps its start. Both sequences keep the same prompt."""
        limit = self.max_length
        if all(len(ids) <= limit for ids, _ in sequences):
            return (*sequences, False)
        starts = [next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
                  for _, labels in sequences]
        longest_answer = max(len(ids) - start for (ids, _), start in zip(sequences, starts))
        cut = []
        for (ids, labels), start in zip(sequences, starts):
            keep = min(start, max(limit - longest_answer, limit // 2))
            head = len(self.bos) if self.bos and ids[:len(self.bos)] == self.bos and keep < start else 0
            kept = list(range(head)) + list(range(start - (keep - head), start))
            kept += list(range(start, min(len(ids), start + limit - len(kept))))
            cut.append(([ids[i] for i in kept], [labels[i] for i in kept]))
        return (*cut, True)

    def _encode_tokenized(self, row: dict, where: str) -> Encoded:
        """The row's ids and labels as they are: no template, no BOS or EOS added. data.train_on_prompt still
        means every token is trained."""
        ids, trained = tokenized_example(row, where, self.vocab_size)
        labels = [token if (keep or self.train_on_prompt) else IGNORE_INDEX for token, keep in zip(ids, trained)]
        return Encoded(ids[: self.max_length], labels[: self.max_length], len(ids) > self.max_length)
