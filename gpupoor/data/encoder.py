"""Row -> token ids and labels, for one format, tokenizer and max_length: the Encoder that training,
`gpupoor tokenize`, `validate --show` and `generate` share.

The format (gpupoor.data.row_formats) reads the row as segments of text; the Encoder renders conversations with the
chat template, tokenizes the segments (each on its own, or the whole text split at the segments' offsets for a
tokenizer that prefixes every input: Encoder.segments_ids) and hands the ids to gpupoor.data.assembly, which joins
them.
"""

from __future__ import annotations

from gpupoor.data.assembly import Encoded, Segment, assemble, join_segments
from gpupoor.data.row_formats import FORMATS, FieldNames
from gpupoor.data.chat_templates import TEMPLATES, missing_template_error, resolve_chat_template
from gpupoor.errors import UserError
from gpupoor.recipe.schema import SHAREGPT_ROLES


class _NotGrowing(Exception):
    """The template renders an earlier turn differently once later turns follow."""


class Encoder:
    """Row -> Encoded, for one format, tokenizer and max_length."""

    def __init__(self, tokenizer, fmt: str, max_length: int, train_on_prompt: bool = False, *,
                 chat_template: str | None = None, sharegpt_roles: dict[str, str] | None = None,
                 **field_names: str):
        """`field_names`: the rows' field names by their recipe keys (gpupoor.recipe.schema.FIELD_KEYS:
        text_field=..., messages_field=..., conversations_field=...); unset ones keep their defaults."""
        self.tokenizer = tokenizer
        self.format = FORMATS[fmt](FieldNames(**field_names, sharegpt_roles=dict(
            SHAREGPT_ROLES if sharegpt_roles is None else sharegpt_roles)))
        self.max_length = max_length
        self.train_on_prompt = train_on_prompt
        # A template name becomes its shipped text, so the cache key follows the text, not the name.
        own = getattr(tokenizer, "chat_template", None)
        self.chat_template = resolve_chat_template(chat_template) or own
        if self.format.needs_chat_template and self.chat_template is None:
            raise missing_template_error("the tokenizer", fmt)
        self.template_name = (f"data.chat_template ({chat_template})" if chat_template in TEMPLATES
                              else "data.chat_template" if chat_template else "the tokenizer's chat template")
        self.vocab_size = len(tokenizer)  # not the model's embedding rows, which may be padded past it
        bos = tokenizer.bos_token_id
        # Add BOS only where the tokenizer itself would (Llama yes, Qwen no).
        self.bos = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []
        if tokenizer.eos_token_id is None and self.format.from_text:
            raise UserError("the tokenizer has no EOS token; gpupoor appends EOS so the model learns to stop")
        self.eos = tokenizer.eos_token_id
        self.whole_text = prefixes_every_input(tokenizer)

    def cache_settings(self) -> dict:
        """Every setting that changes what encode() returns for a row (for a tokenization cache key)."""
        return {"format": self.format.name, "max_length": self.max_length, "train_on_prompt": self.train_on_prompt,
                **self.format.cache_fields(),
                "template": self.chat_template if self.format.may_use_chat_template else None,
                # Only where it changes the ids (a space-prefixing tokenizer): other tokenizers' caches and the
                # data identity their checkpoints recorded stay as they were.
                "segments": "whole text, split at offsets" if self.whole_text else None}

    def encode(self, row: dict, where: str) -> Encoded:
        return self.format.encode(row, where, self)

    def segments(self, row: dict, where: str) -> list[Segment]:
        """The row as (text, trainable) pieces; EOS handling is done by the assembly."""
        return self.format.segments(row, where, self)

    def prompt_segments(self, row: dict, where: str) -> list[Segment]:
        """The prompt of a row as training rendered it, ending where the model's answer starts."""
        return self.format.prompt_segments(row, where, self)

    def encode_prompt(self, row: dict, where: str) -> list[int]:
        """Token ids of the prompt, tokenized exactly as in training (same BOS rule, same segments)."""
        segments = self.prompt_segments(row, where)
        return join_segments(self, segments, self.segment_ids(segments))[0]

    def encode_segments(self, segments: list[Segment]) -> Encoded:
        """A training example of these segments (assembly.assemble of Encoder.segment_ids)."""
        return assemble(self, segments, self.segment_ids(segments))

    def segment_ids(self, segments: list[Segment]) -> list[list[int]]:
        return self.segments_ids([segments])[0]

    def segments_ids(self, examples: list[list[Segment]]) -> list[list[list[int]]]:
        """Each example's segments' token ids, in one tokenizer call. Segments are tokenized on their own, so labels
        fall on token boundaries; but a tokenizer that puts ▁ before every input (Llama 2's, Mistral's, Phi-3's
        SentencePiece layout) would start each segment after the first with a ▁ the whole text does not have
        ("\n" + "answer" as "▁answer"). For those the example is tokenized whole and each token goes to the segment
        of its last character: the ids are the whole text's, and a token across a boundary counts as the later
        segment's (a prompt ending in a space, "A: " + "sort", trains "▁sort", not nothing)."""
        if not self.whole_text:
            texts = [text for segments in examples for text, _ in segments]
            tokenized = iter(self.tokenizer(texts, add_special_tokens=False).input_ids if texts else [])
            return [[next(tokenized) for _ in segments] for segments in examples]
        joined = ["".join(text for text, _ in segments) for segments in examples]
        encoded = self.tokenizer(joined, add_special_tokens=False, return_offsets_mapping=True)
        return [split_at_offsets(ids, offsets, [len(text) for text, _ in segments])
                for ids, offsets, segments in zip(encoded.input_ids, encoded["offset_mapping"], examples)]

    def render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.chat_template,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template is user code: jinja2 errors, raise_exception(), TypeError...
            raise UserError(f"{where}: {self.template_name} failed on this row ({len(messages)} messages, "
                            f"add_generation_prompt={generation_prompt}): {type(exc).__name__}: {exc}",
                            hint="fix the template, or the row if the template rejects it on purpose") from None

    def chat_segments(self, messages: list[dict], where: str) -> list[Segment]:
        # Render prefix by prefix: the text an assistant turn adds is its completion; the generation
        # prompt before it (e.g. "<|im_start|>assistant\n") stays a prompt.
        boundaries: list[Segment] = []  # (the conversation rendered up to here, is the last stretch trained)
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                boundaries.append((self.render(messages[:index], True, where), False))
            boundaries.append((self.render(messages[: index + 1], False, where), message["role"] == "assistant"))
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

    def _located_segments(self, messages: list[dict], where: str) -> list[Segment]:
        """For a template that moves text as the conversation grows (Mistral's puts the system prompt in the
        last user turn): render the whole conversation once and find each assistant reply in it, in order, as
        the template renders that reply when it is the last turn. Where the full rendering starts with the
        text before the reply, the reply's place is exact; otherwise it is the next occurrence."""
        full = self.render(messages, False, where)
        eos = self.tokenizer.eos_token or ""
        pieces, cursor = [], 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:index], True, where)
            after = self.render(messages[: index + 1], False, where)
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


def prefixes_every_input(tokenizer) -> bool:
    """Does the tokenizer put a space before the text it is given (SentencePiece's add_dummy_prefix, as tokenizer.json
    writes it: a Prepend("▁") normalizer or a Metaspace pre-tokenizer that prepends; or byte-level BPE with
    add_prefix_space)? Only a fast tokenizer can say where its tokens come from (offsets): a slow one is tokenized
    segment by segment whatever it does (docs/data.md)."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return False

    def parts(node) -> list[dict]:  # a normalizer or pre-tokenizer, and the members of a Sequence
        if not isinstance(node, dict):
            return []
        return [node, *(part for key in ("normalizers", "pretokenizers") for child in node.get(key) or []
                        for part in parts(child))]

    spec = json.loads(backend.to_str())
    return any(part.get("type") == "Prepend" for part in parts(spec.get("normalizer"))) or any(
        (part.get("type") == "Metaspace" and (part.get("prepend_scheme", "always") != "never"
                                              if "prepend_scheme" in part else part.get("add_prefix_space", True)))
        or (part.get("type") == "ByteLevel" and part.get("add_prefix_space", False))
        for part in parts(spec.get("pre_tokenizer")))


def split_at_offsets(ids: list[int], offsets: list[tuple[int, int]], lengths: list[int]) -> list[list[int]]:
    """The tokens of a text made of segments of `lengths` characters, each given to the segment its last character
    is in: "▁sort" of "A: " + "sort" is the completion's; a special token that swallows the whitespace before it
    (lstrip) is the segment it opens."""
    ends, total = [], 0
    for length in lengths:
        total += length
        ends.append(total)
    pieces: list[list[int]] = [[] for _ in lengths]
    segment = 0
    for token, (start, end) in zip(ids, offsets):
        last = max(start, end - 1)  # a token of no characters (none with add_special_tokens=False): where it is
        while segment < len(ends) - 1 and last >= ends[segment]:
            segment += 1
        pieces[segment].append(token)
    return pieces
