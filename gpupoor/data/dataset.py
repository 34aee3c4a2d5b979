"""Tokenized examples stored flat (one ids tensor + offsets), cached on disk as safetensors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gpupoor.data.formats import IGNORE_INDEX, Encoder
from gpupoor.data.loading import Row
from gpupoor.files import atomic_file

CACHE_VERSION = "1"  # bump when tokenization semantics change


@dataclass
class TokenStats:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    target_tokens: int = 0


class TokenizedDataset:
    """Examples i = ids[offsets[i]:offsets[i+1]]; labels are ids where `target` is set, else -100."""

    def __init__(self, ids: torch.Tensor, target: torch.Tensor, offsets: torch.Tensor, stats: TokenStats):
        self.ids, self.target, self.offsets, self.stats = ids, target, offsets, stats
        self.lengths = (offsets[1:] - offsets[:-1]).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        ids = self.ids[start:end].long()
        labels = torch.where(self.target[start:end].bool(), ids, IGNORE_INDEX)
        return ids, labels

    def subset(self, indices: list[int]) -> "TokenizedDataset":
        pieces = [(self.ids[self.offsets[i]:self.offsets[i + 1]], self.target[self.offsets[i]:self.offsets[i + 1]])
                  for i in indices]
        return _from_pieces(pieces, TokenStats(rows=len(indices), kept=len(indices)))

    def content_hash(self) -> str:
        digest = hashlib.sha256()
        for tensor in (self.ids, self.target, self.offsets):
            digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
            digest.update(tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, fsync, rename, fsync of the folder) with the content's hash in the
        metadata, so a power cut leaves the old entry or the whole new one, and `load` can check it."""
        from safetensors.torch import save_file

        with atomic_file(path) as tmp:
            save_file({"ids": self.ids, "target": self.target, "offsets": self.offsets}, tmp,
                      metadata={"stats": json.dumps(self.stats.__dict__), "sha256": self.content_hash()})

    @classmethod
    def load(cls, path: Path) -> "TokenizedDataset":
        """Read a cache entry and check it against the hash it was written with. Raises CacheEntryInvalid."""
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
                stats = TokenStats(**json.loads(metadata["stats"]))
                dataset = cls(handle.get_tensor("ids"), handle.get_tensor("target"), handle.get_tensor("offsets"),
                              stats)
        except Exception as exc:  # safetensors raises its own error types for truncated or garbled files
            raise CacheEntryInvalid(f"unreadable ({type(exc).__name__}: {exc})") from None
        if "sha256" not in metadata:
            raise CacheEntryInvalid("it has no content hash (written by an older gpupoor)")
        if metadata["sha256"] != dataset.content_hash():
            raise CacheEntryInvalid("its content does not match the hash it was written with")
        return dataset


class CacheEntryInvalid(Exception):
    """A tokenized-cache file that cannot be trusted: it is tokenized again."""


def _from_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], stats: TokenStats) -> TokenizedDataset:
    lengths = torch.tensor([len(ids) for ids, _ in pieces], dtype=torch.int64)
    offsets = torch.zeros(len(pieces) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.int32)
    target = torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.uint8)
    return TokenizedDataset(ids, target, offsets, stats)


def tokenize_rows(rows: list[Row], encoder: Encoder) -> TokenizedDataset:
    stats = TokenStats(rows=len(rows))
    pieces = []
    for row in rows:
        encoded = encoder.encode(row.fields, row.where)
        target = [label != IGNORE_INDEX for label in encoded.labels[1:]]  # label at 0 is never predicted
        if not any(target):
            stats.dropped_no_target += 1  # nothing to learn from, e.g. a prompt longer than max_length
            continue
        stats.truncated += encoded.truncated
        stats.kept += 1
        stats.tokens += len(encoded.input_ids)
        stats.target_tokens += sum(target)
        pieces.append((torch.tensor(encoded.input_ids, dtype=torch.int32),
                       torch.tensor([label != IGNORE_INDEX for label in encoded.labels], dtype=torch.uint8)))
    return _from_pieces(pieces, stats)


def tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    digest.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer("a").input_ids)).encode())
    return digest.hexdigest()


def cache_key(data_fingerprint: str, tokenizer, encoder: Encoder) -> str:
    settings = {
        "version": CACHE_VERSION, "format": encoder.fmt, "max_length": encoder.max_length,
        "train_on_prompt": encoder.train_on_prompt, "text_field": encoder.text_field,
        "messages_field": encoder.messages_field,
        "template": encoder.chat_template if encoder.fmt == "chat" else None,
    }
    digest = hashlib.sha256(data_fingerprint.encode())
    digest.update(tokenizer_fingerprint(tokenizer).encode())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()[:32]

