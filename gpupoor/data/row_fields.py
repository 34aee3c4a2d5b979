"""Checks on a raw row's fields, shared by the data formats: each names file:line and the field that is missing or
of the wrong kind, and says what the format allows (a chat turn's role, a token id, a preference pair's shape)."""

from __future__ import annotations

import json
import numbers

from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.errors import UserError
from gpupoor.recipe.schema import SHAREGPT_ROLES


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


# The fields that make a row of each format (the default field names), most specific first.
FORMAT_FIELDS = (("preference", ("prompt", "chosen", "rejected")), ("completion", ("prompt", "completion")),
                 ("alpaca", ("instruction", "output")), ("chat", ("messages",)), ("sharegpt", ("conversations",)),
                 ("tokenized", ("input_ids",)), ("text", ("text",)))


def format_of_fields(row: dict, fmt: str) -> str | None:
    """The format whose fields the row has, when it is not `fmt` (alpaca rows under the default `format: text`)."""
    return next((name for name, fields in FORMAT_FIELDS if name != fmt and all(f in row for f in fields)), None)


def string_field(row: dict, name: str, where: str, fmt: str, *, required: bool = True) -> str:
    """A string field of a row (an optional one may be missing or null: then "")."""
    value = row.get(name)
    if value is None and (name not in row or not required):  # an optional field may be null (a parquet gap)
        if not required:
            return ""
        other = format_of_fields(row, fmt)
        raise UserError(f"{where}: missing field '{name}' (format {fmt} needs it; the row has "
                        f"{', '.join(map(repr, row)) or 'no fields'})",
                        hint=f"its fields are those of format {other}: set data.format: {other} (or the source's "
                        "format in data.datasets)" if other else None)
    if not isinstance(value, str):
        raise wrong_type(where, name, value)
    return value


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_messages(row: dict, where: str, messages_field: str = "messages", *,
                  needs_assistant: bool = True) -> list[dict]:
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


def sharegpt_messages(row: dict, where: str, conversations_field: str = "conversations", *,
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
        return tuple(string_field(row, name, where, "preference") for name in PREFERENCE_FIELDS)
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
