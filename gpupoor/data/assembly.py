"""How a row's segments become input_ids and labels: the one token assembly that training, `gpupoor tokenize` and
`generate` share. A format renders a row as segments of text, each trained or not; the Encoder tokenizes them (each
on its own, so the boundary between prompt and completion is exact in token space, or split from the whole text
for a tokenizer that prefixes every input) and they are joined here: BOS where the
tokenizer adds one, prompt tokens labelled IGNORE_INDEX, EOS once at the end, then truncation to max_length.

`encoder` below is a gpupoor.data.encoder.Encoder (its tokenizer, bos, eos, train_on_prompt and max_length).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

IGNORE_INDEX = -100

Segment = tuple[str, bool]  # (text, trained)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    # Where each sequence after the first starts: a `preference` pair is its chosen sequence (prompt + chosen
    # answer), then its rejected one, stored as one example so that nothing can split it.
    sequence_starts: tuple[int, ...] = ()


def join_segments(encoder, segments: list[Segment], segment_ids: Iterable[list[int]]
                  ) -> tuple[list[int], list[int], list[int]]:
    """(ids, labels, ids of the last trained segment), no EOS yet. `segment_ids`: each segment's token ids, in
    order. A prompt segment is labelled IGNORE_INDEX unless data.train_on_prompt."""
    bos_text = encoder.tokenizer.bos_token or "\0"
    ids: list[int] = list(encoder.bos)
    labels: list[int] = [IGNORE_INDEX] * len(ids)
    last_completion: list[int] = []
    for (text, trainable), piece in zip(segments, segment_ids):
        if encoder.bos and not ids[len(encoder.bos):] and text.startswith(bos_text):
            ids, labels = [], []  # the chat template already writes BOS
        ids += piece
        labels += piece if (trainable or encoder.train_on_prompt) else [IGNORE_INDEX] * len(piece)
        if trainable:
            last_completion = piece
    return ids, labels, last_completion


def with_eos(encoder, ids: list[int], labels: list[int], last_completion: list[int]) -> tuple[list[int], list[int]]:
    # A chat template may end each turn with EOS itself (Qwen's <|im_end|>), or the conversation (Phi-3);
    # otherwise append it.
    if encoder.eos not in last_completion and ids[-1:] != [encoder.eos]:
        ids.append(encoder.eos)
        labels.append(encoder.eos)  # trained, so the model learns to stop
    return ids, labels


def assemble(encoder, segments: list[Segment], segment_ids: Iterable[list[int]]) -> Encoded:
    """One training example: the segments joined, EOS once, cut to max_length."""
    ids, labels = with_eos(encoder, *join_segments(encoder, segments, segment_ids))
    limit = encoder.max_length
    return Encoded(ids[:limit], labels[:limit], len(ids) > limit)


def truncate_pair(sequences: list[tuple[list[int], list[int]]], max_length: int, bos: list[int]
                  ) -> tuple[tuple, tuple, bool]:
    """Each sequence cut to max_length: the prompt (the tokens before the first trained one) keeps its end
    (and a leading BOS), at least half of max_length when it is that long, and no more than the longer answer
    leaves; then each answer keeps its start. Both sequences keep the same prompt."""
    limit = max_length
    if all(len(ids) <= limit for ids, _ in sequences):
        return (*sequences, False)
    starts = [next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
              for _, labels in sequences]
    longest_answer = max(len(ids) - start for (ids, _), start in zip(sequences, starts))
    cut = []
    for (ids, labels), start in zip(sequences, starts):
        keep = min(start, max(limit - longest_answer, limit // 2))
        head = len(bos) if bos and ids[:len(bos)] == bos and keep < start else 0
        kept = list(range(head)) + list(range(start - (keep - head), start))
        kept += list(range(start, min(len(ids), start + limit - len(kept))))
        cut.append(([ids[i] for i in kept], [labels[i] for i in kept]))
    return (*cut, True)
