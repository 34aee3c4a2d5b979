"""The data formats, one class each behind one interface (Format), and FORMATS, the table that names them.

A format knows its rows: how to check one (naming the bad field), how it reads as segments of text, each trained
or not (training, `gpupoor tokenize`, `validate --show`), and as the prompt that training rendered, ending where
the answer starts (`generate`). Tokenizing is the same for every format: gpupoor.data.encoder renders chat
templates and gpupoor.data.assembly joins the segments' tokens. A new format is one class here, one entry in
FORMATS and its name in recipe.schema.DATA_FORMATS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpupoor.data.assembly import IGNORE_INDEX, Encoded, Segment, join_segments, truncate_pair, with_eos
from gpupoor.data.row_fields import (chat_messages, preference_parts, sharegpt_messages, string_field,
                                     tokenized_example)
from gpupoor.data.chat_templates import missing_template_error
from gpupoor.errors import UserError
from gpupoor.recipe.schema import FIELD_KEYS, SHAREGPT_ROLES

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    if input_text:
        return ALPACA_PROMPT.format(with_input=", paired with an input that provides further context",
                                    instruction=instruction, input_block=f"### Input:\n{input_text}\n\n")
    return ALPACA_PROMPT.format(with_input="", instruction=instruction, input_block="")


@dataclass
class FieldNames:
    """A source's names for its rows' fields: one attribute per recipe key of gpupoor.recipe.schema.FIELD_KEYS,
    under the key's own name, and data.sharegpt_roles."""
    text_field: str = "text"
    messages_field: str = "messages"
    conversations_field: str = "conversations"
    sharegpt_roles: dict[str, str] = field(default_factory=lambda: dict(SHAREGPT_ROLES))

    @classmethod
    def of(cls, section, sharegpt_roles: dict[str, str] | None = None) -> "FieldNames":
        """The names a recipe section (a resolved source, or `data`) gives."""
        return cls(**{key: getattr(section, key) for key in FIELD_KEYS},
                   sharegpt_roles=dict(SHAREGPT_ROLES if sharegpt_roles is None else sharegpt_roles))


class Format:
    """What every format answers. `encoder` (a gpupoor.data.encoder.Encoder) renders chat templates and tokenizes;
    a format never tokenizes text itself, so training, `gpupoor tokenize` and `generate` assemble tokens alike."""

    name = ""
    needs_chat_template = False  # every row is a conversation rendered with a chat template
    may_use_chat_template = False  # some rows may be (the template is then part of what a row becomes)
    from_text = True  # False: rows bring their own token ids (no template, BOS or EOS added)
    batched = True  # encode() is segments() + assembly.assemble, so `gpupoor tokenize` batches the tokenizer calls
    has_prompt_field = False  # its rows have a field 'prompt' of their own (generate checks it as part of the row)
    pairs = False  # an example is a pair of sequences (chosen, then rejected), batched whole
    conversation_field = ""  # what errors call the messages conversation() returns

    def __init__(self, names: FieldNames | None = None):
        self.names = names or FieldNames()

    def check(self, row: dict, where: str, *, needs_assistant: bool = True) -> None:
        """Raise a UserError naming file:line and the field when the row does not fit the format.
        `needs_assistant`: a conversation must have an assistant turn (without data.train_on_prompt there is
        nothing else to learn from); a prompt for `generate` need not."""
        raise NotImplementedError

    def segments(self, row: dict, where: str, encoder) -> list[Segment]:
        """The row as (text, trained) pieces for training; EOS is added by the assembly."""
        raise NotImplementedError

    def prompt_segments(self, row: dict, where: str, encoder) -> list[Segment]:
        """The prompt of a row as training rendered it, ending where the model's answer starts."""
        raise NotImplementedError

    def prompt_row(self, text: str) -> dict:
        """A row of this format (with the source's field names) holding one user prompt (generate --prompt)."""
        raise NotImplementedError

    def as_prompt(self, row: dict) -> dict:
        """A row of a prompts file (generate --file) as the row whose prompt is rendered."""
        return row

    def expected_answer(self, row: dict, where: str) -> str:
        """The answer a held-out row expects after its prompt (`gpupoor eval` compares the model's with it)."""
        raise UserError(f"{where}: a {self.name} row holds no answer apart from its prompt, so there is nothing to "
                        "compare a generated answer with",
                        hint="evaluate on rows with an answer: alpaca (output), completion, chat or sharegpt (the "
                        "last assistant turn)")

    def encode(self, row: dict, where: str, encoder) -> Encoded:
        """The training example of a row."""
        return encoder.encode_segments(self.segments(row, where, encoder))

    def conversation(self, row: dict, where: str) -> list[dict] | None:
        """The messages a chat template renders for this (checked) row, or None: validate renders them with
        data.chat_template."""
        return None

    def cache_fields(self) -> dict:
        """The field settings in the tokenization cache key. The first cache version hashed text_field and
        messages_field for every format; settings added since are None where they do not apply."""
        return {"text_field": self.names.text_field, "messages_field": self.names.messages_field,
                "conversations_field": None, "sharegpt_roles": None}

    def warnings(self, rows: list, key: str, limit: int) -> list[str]:
        """What is allowed but likely a mistake in these checked rows (gpupoor.data.loading.Row, at most
        `limit` of them read)."""
        return []


class Text(Format):
    """{"text": ...}: every token trained; generate continues the text."""

    name = "text"

    def check(self, row: dict, where: str, *, needs_assistant: bool = True) -> None:
        string_field(row, self.names.text_field, where, self.name)

    def segments(self, row: dict, where: str, encoder) -> list[Segment]:
        return [(string_field(row, self.names.text_field, where, self.name), True)]

    def prompt_segments(self, row: dict, where: str, encoder) -> list[Segment]:
        return [(string_field(row, self.names.text_field, where, self.name), False)]

    def prompt_row(self, text: str) -> dict:
        return {self.names.text_field: text}


class PromptAndResponse(Format):
    """A prompt that is not trained, then the response that is; generate's prompt is the same prompt."""

    def prompt(self, row: dict, where: str) -> str:
        raise NotImplementedError

    def response(self, row: dict, where: str) -> str:
        raise NotImplementedError

    def check(self, row: dict, where: str, *, needs_assistant: bool = True) -> None:
        self.prompt(row, where)
        self.response(row, where)

    def segments(self, row: dict, where: str, encoder) -> list[Segment]:
        return [(self.prompt(row, where), False), (self.response(row, where), True)]

    def prompt_segments(self, row: dict, where: str, encoder) -> list[Segment]:
        return [(self.prompt(row, where), False)]

    def expected_answer(self, row: dict, where: str) -> str:
        return self.response(row, where)


class Alpaca(PromptAndResponse):
    """{"instruction", "input" (optional), "output"}, the prompt in Alpaca's template."""

    name = "alpaca"

    def prompt(self, row: dict, where: str) -> str:
        return alpaca_prompt(string_field(row, "instruction", where, self.name),
                             string_field(row, "input", where, self.name, required=False))

    def response(self, row: dict, where: str) -> str:
        return string_field(row, "output", where, self.name)

    def prompt_row(self, text: str) -> dict:
        return {"instruction": text}


class Completion(PromptAndResponse):
    """{"prompt", "completion"}, both as they are."""

    name = "completion"
    has_prompt_field = True

    def prompt(self, row: dict, where: str) -> str:
        return string_field(row, "prompt", where, self.name)

    def response(self, row: dict, where: str) -> str:
        return string_field(row, "completion", where, self.name)

    def prompt_row(self, text: str) -> dict:
        return {"prompt": text}


class Conversation(Format):
    """A list of messages rendered with a chat template; the assistant turns are trained."""

    needs_chat_template = may_use_chat_template = True

    def messages(self, row: dict, where: str, *, needs_assistant: bool = True) -> list[dict]:
        """The row as checked {role, content} messages."""
        raise NotImplementedError

    def check(self, row: dict, where: str, *, needs_assistant: bool = True) -> None:
        self.messages(row, where, needs_assistant=needs_assistant)

    def segments(self, row: dict, where: str, encoder) -> list[Segment]:
        return encoder.chat_segments(self.messages(row, where, needs_assistant=not encoder.train_on_prompt), where)

    def prompt_segments(self, row: dict, where: str, encoder) -> list[Segment]:
        """The conversation up to its trailing assistant turns (the expected answer), with the generation prompt."""
        messages = list(self.messages(row, where, needs_assistant=False))
        while len(messages) > 1 and messages[-1]["role"] == "assistant":
            messages.pop()
        return [(encoder.render(messages, True, where), False)]

    def conversation(self, row: dict, where: str) -> list[dict] | None:
        return self.messages(row, where, needs_assistant=False)

    def expected_answer(self, row: dict, where: str) -> str:
        """The trailing assistant turn, which prompt_segments leaves out."""
        messages = self.messages(row, where, needs_assistant=False)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise UserError(f"{where}: the conversation does not end with an assistant turn, the answer to compare "
                            "with", hint="end each held-out conversation with the expected assistant reply")
        return messages[-1]["content"]


class Chat(Conversation):
    """{"messages": [{role, content}, ...]}."""

    name = "chat"

    @property
    def conversation_field(self) -> str:
        return self.names.messages_field

    def messages(self, row: dict, where: str, *, needs_assistant: bool = True) -> list[dict]:
        return chat_messages(row, where, self.names.messages_field, needs_assistant=needs_assistant)

    def prompt_row(self, text: str) -> dict:
        return {self.names.messages_field: [{"role": "user", "content": text}]}

    def as_prompt(self, row: dict) -> dict:
        """The trailing assistant turns (the expected answer) dropped, so the model writes its own."""
        if not isinstance(row.get(self.names.messages_field), list):
            return row
        messages = list(row[self.names.messages_field])
        while messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            messages.pop()
        return {**row, self.names.messages_field: messages}


class ShareGPT(Conversation):
    """{"conversations": [{from, value}, ...]}, `from` mapped to a role by data.sharegpt_roles."""

    name = "sharegpt"

    @property
    def conversation_field(self) -> str:
        return self.names.conversations_field

    def messages(self, row: dict, where: str, *, needs_assistant: bool = True) -> list[dict]:
        return sharegpt_messages(row, where, self.names.conversations_field, roles=self.names.sharegpt_roles,
                                 needs_assistant=needs_assistant)

    def prompt_row(self, text: str) -> dict:
        user = next((name for name, role in self.names.sharegpt_roles.items() if role == "user"), "human")
        return {self.names.conversations_field: [{"from": user, "value": text}]}

    def cache_fields(self) -> dict:
        return {**super().cache_fields(), "conversations_field": self.names.conversations_field,
                "sharegpt_roles": self.names.sharegpt_roles}


class Tokenized(Format):
    """{"input_ids", "labels" or "loss_mask"}: token ids as they are, no template, BOS or EOS added."""

    name = "tokenized"
    from_text = False
    batched = False

    def check(self, row: dict, where: str, *, needs_assistant: bool = True) -> None:
        tokenized_example(row, where)  # the ids are checked against the vocabulary by encode(), with a tokenizer

    def segments(self, row: dict, where: str, encoder) -> list[Segment]:
        raise UserError(f"{where}: a tokenized row holds token ids, not text to render",
                        hint="use a text format (text, alpaca, chat, sharegpt, completion) for prompts")

    def prompt_segments(self, row: dict, where: str, encoder) -> list[Segment]:
        raise UserError(f"{where}: a tokenized row holds token ids, not a prompt to render",
                        hint="give prompts in a text format (e.g. generate --format text)")

    def prompt_row(self, text: str) -> dict:
        return {self.names.text_field: text}  # refused by prompt_segments, as any prompt of this format

    def encode(self, row: dict, where: str, encoder) -> Encoded:
        """The row's ids and labels as they are. data.train_on_prompt still means every token is trained."""
        ids, trained = tokenized_example(row, where, encoder.vocab_size)
        labels = [token if (keep or encoder.train_on_prompt) else IGNORE_INDEX for token, keep in zip(ids, trained)]
        limit = encoder.max_length
        return Encoded(ids[:limit], labels[:limit], len(ids) > limit)


class Preference(Format):
    """{"prompt", "chosen", "rejected"}: strings, or message lists rendered with the chat template."""

    name = "preference"
    may_use_chat_template = True
    batched = False
    has_prompt_field = True
    pairs = True
    conversation_field = "prompt + chosen"

    def check(self, row: dict, where: str, *, needs_assistant: bool = True) -> None:
        preference_parts(row, where)

    def segments(self, row: dict, where: str, encoder) -> list[Segment]:
        raise ValueError("a preference row is two sequences: Preference.encode renders it")

    def prompt_segments(self, row: dict, where: str, encoder) -> list[Segment]:
        """The prompt alone (a prompts file), or a pair's."""
        if isinstance(row.get("prompt"), str):
            return [(row["prompt"], False)]
        messages = chat_messages(row, where, "prompt", needs_assistant=False) if row.get("prompt") is not None \
            else preference_parts(row, where)[0]
        return [(encoder.render(messages, True, where), False)]

    def prompt_row(self, text: str) -> dict:
        return {"prompt": text}

    def encode(self, row: dict, where: str, encoder) -> Encoded:
        """A pair as one example: the chosen sequence (prompt + chosen answer, EOS), then the rejected one; labels
        on the answers only. Truncation keeps each sequence within max_length: the prompt keeps its end, the
        answers their start (see assembly.truncate_pair)."""
        prompt, chosen, rejected = preference_parts(row, where)
        sequences = []
        for answer in (chosen, rejected):
            segments = self._pair_segments(prompt, answer, where, encoder)
            sequences.append(with_eos(encoder, *join_segments(encoder, segments, encoder.segment_ids(segments))))
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels), truncated = truncate_pair(
            sequences, encoder.max_length, encoder.bos)
        return Encoded(chosen_ids + rejected_ids, chosen_labels + rejected_labels, truncated, (len(chosen_ids),))

    @staticmethod
    def _pair_segments(prompt, answer, where: str, encoder) -> list[Segment]:
        if isinstance(prompt, str):
            return [(prompt, False), (answer, True)]
        if encoder.chat_template is None:
            raise missing_template_error("the tokenizer", "preference (with message lists)")
        segments = encoder.chat_segments(prompt + answer, where)
        # Assistant turns inside the prompt are context, not the answer: only the answer's turns are trained.
        context = sum(message["role"] == "assistant" for message in prompt)
        marked = []
        for text, trainable in segments:
            if trainable and context:
                context, trainable = context - 1, False
            marked.append((text, trainable))
        return marked

    def conversation(self, row: dict, where: str) -> list[dict] | None:
        prompt, chosen, _ = preference_parts(row, where)
        return None if isinstance(prompt, str) else prompt + chosen

    def warnings(self, rows: list, key: str, limit: int) -> list[str]:
        """Pairs whose chosen and rejected answers are the same teach no preference (the DPO loss stays at ln 2
        whatever the model does): usually a field mapped twice upstream."""
        same = [row.where for row in rows if _answers_equal(row)]
        if not same:
            return []
        read = f"the first {len(rows)}" if len(rows) == limit else f"{len(rows)}"
        return [f"{key}: chosen is identical to rejected in {'all' if len(same) == len(rows) else len(same)} of "
                f"{read} pairs (the first at {same[0]}): such a pair teaches no preference (DPO's loss and ORPO's "
                "odds-ratio term stay at ln 2 = 0.693 on it, whatever the model does); check how the pairs were "
                "built"]


def _answers_equal(row) -> bool:
    _, chosen, rejected = preference_parts(row.fields, row.where)
    return chosen == rejected


# data.format's values and their classes.
FORMATS: dict[str, type[Format]] = {format_.name: format_ for format_ in
                                    (Text, Alpaca, Completion, Chat, ShareGPT, Tokenized, Preference)}


def sequences_per_example(formats) -> int:
    """How many sequences of up to data.max_length one example is: 2 when every source holds preference pairs
    (chosen and rejected, batched whole), else 1. The one rule the collation, the packer's row length and the
    memory and time plans read (recipe.rules keeps pairs and the preference objectives together)."""
    formats = list(formats)
    return 2 if formats and all(FORMATS[name].pairs for name in formats) else 1
