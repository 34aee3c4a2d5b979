"""Tokenized examples stored flat (ids, target flags, offsets), cached on disk as memory-mapped safetensors files.

The file format: safetensors (8 bytes of header length, a JSON header, the raw tensors), with the content hash
and the stats in the header's metadata. It loads no pickle, any safetensors reader opens it, and it is one file
per entry. We map it ourselves instead of through safetensors' reader: the header is trivial to parse, and
`safe_open` maps lazily only in recent versions (older ones, which the project allows, copy every tensor into
memory). torch.load(mmap=True) would need its zip layout and restricted unpickler; .npy, one file per array.

A loaded dataset is a view of a copy-on-write mapping of the file: the tokens are file-backed pages that the kernel
reads when training touches them and may drop again, so data larger than RAM trains and a process's memory does
not grow with the token count. What stays in memory per example: its length (a Python list, as the samplers
index it: 8 bytes a row, more for lengths above 256) and, in a mixture or a held-out split, its index (8 bytes).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from gpupoor.data.assembly import IGNORE_INDEX, Encoded
from gpupoor.data.encoder import Encoder
from gpupoor.data.loading import Row
from gpupoor.storage.files import atomic_file

CACHE_VERSION = "2"  # bump when tokenization semantics or the file layout change (2: streamed, mapped files)

# name -> (safetensors dtype, numpy dtype). Widest first, so every tensor starts aligned to its element size
# (the data region starts 8-aligned) and can be viewed in place.
_LAYOUT = {"offsets": ("I64", np.int64), "ids": ("I32", np.int32), "target": ("U8", np.uint8)}
_TORCH = {np.int64: torch.int64, np.int32: torch.int32, np.uint8: torch.uint8}
_BLOCK = 1 << 20  # bytes read at a time when hashing
_EXAMPLES_PER_BLOCK = 8192  # examples gathered at a time when a dataset is saved or hashed...
_TOKENS_PER_BLOCK = 1 << 20  # ...and at most this many tokens (unless one example is longer)
_MAX_HEADER = 1 << 24  # a header is a few hundred bytes; a larger length field is garbage, not a header


@dataclass
class TokenStats:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    target_tokens: int = 0

    def add(self, other: "TokenStats") -> None:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))


# A token's target flag: trained, or (a code the first token of a sequence may carry, as it is never a target) the
# start of another sequence of the same example: a preference pair is its chosen sequence, then its rejected one.
TRAINED, SEQUENCE_START = 1, 2


@dataclass
class Chunk:
    """Examples tokenized together: tokens and target flags flat, one length per example."""

    ids: np.ndarray  # int32
    target: np.ndarray  # uint8: TRAINED where the token is trained, SEQUENCE_START where a later sequence starts
    lengths: np.ndarray  # int64
    stats: TokenStats


def encoded_chunk(encoded: list[Encoded]) -> Chunk:
    """Encoded rows as a Chunk; a row with a sequence that has no trained token after its first is dropped
    (nothing to learn; a pair without one of its answers compares nothing)."""
    stats = TokenStats(rows=len(encoded))
    ids: list[int] = []
    target: list[int] = []
    lengths: list[int] = []
    for example in encoded:
        trained = [int(label != IGNORE_INDEX) for label in example.labels]
        bounds = (0, *example.sequence_starts, len(trained))
        counts = [sum(trained[start + 1:end]) for start, end in zip(bounds, bounds[1:])]  # a first label is never predicted
        if not all(counts):
            stats.dropped_no_target += 1  # e.g. a prompt longer than max_length
            continue
        for start in example.sequence_starts:
            trained[start] = SEQUENCE_START
        stats.truncated += int(example.truncated)
        stats.kept += 1
        stats.tokens += len(example.input_ids)
        stats.target_tokens += sum(counts)
        ids += example.input_ids
        target += trained
        lengths.append(len(example.input_ids))
    return Chunk(np.array(ids, dtype=np.int32), np.array(target, dtype=np.uint8), np.array(lengths, dtype=np.int64),
                 stats)


class _Shard:
    """One flat run of examples: example k is ids[offsets[k]:offsets[k+1]]. `source`: for a mapped file, a file
    descriptor of it and where its ids and target start, so a scan of every token can read the file instead."""

    def __init__(self, ids: torch.Tensor, target: torch.Tensor, offsets: torch.Tensor,
                 source: tuple[int, int, int] | None = None):
        self.ids, self.target, self.offsets = ids, target, offsets
        # numpy views of the same memory: indexing them per example costs far less than indexing tensors.
        self.ids_np, self.target_np, self.offsets_np = ids.numpy(), target.numpy(), offsets.numpy()
        self.source = source
        if source is not None:
            weakref.finalize(self, os.close, source[0])

    def __len__(self) -> int:
        return len(self.offsets_np) - 1

    def tokens(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """ids and target of tokens [start, end). From a mapped file they are read with pread: a scan of the whole
        dataset (save, hash) then goes through the page cache instead of faulting every page into this process,
        whose resident memory would otherwise grow to the file's size."""
        if self.source is None:
            return self.ids_np[start:end], self.target_np[start:end]
        fd, ids_at, target_at = self.source
        ids = os.pread(fd, 4 * (end - start), ids_at + 4 * start)
        target = os.pread(fd, end - start, target_at + start)
        if len(ids) != 4 * (end - start) or len(target) != end - start:
            raise RuntimeError(f"a tokenized file was cut short while in use (fd {fd}); it is replaced by rename "
                               "only, so something else wrote to it")
        return np.frombuffer(ids, dtype=np.int32), np.frombuffer(target, dtype=np.uint8)


class TokenizedDataset:
    """Examples i = ids[offsets[i]:offsets[i+1]]; labels are ids where `target` is set, else -100.

    Concatenating (a mixture's sources) and selecting (held-out rows) make views of the same shards, never copies:
    a memory-mapped dataset stays mapped."""

    def __init__(self, ids: torch.Tensor, target: torch.Tensor, offsets: torch.Tensor, stats: TokenStats):
        self._setup([_Shard(ids, target, offsets)], None, stats)

    def _setup(self, shards: list[_Shard], select: np.ndarray | None, stats: TokenStats) -> None:
        self._shards, self._select, self.stats = shards, select, stats
        self._first = [0]  # index of each shard's first example among all shards' examples
        for shard in shards:
            self._first.append(self._first[-1] + len(shard))
        lengths = np.concatenate([np.diff(shard.offsets_np) for shard in shards])
        self.lengths: list[int] = (lengths if select is None else lengths[select]).tolist()

    @classmethod
    def _view(cls, shards: list[_Shard], select: np.ndarray | None, stats: TokenStats) -> "TokenizedDataset":
        dataset = cls.__new__(cls)
        dataset._setup(shards, select, stats)
        return dataset

    def __len__(self) -> int:
        return len(self.lengths)

    def _locate(self, index: int) -> tuple[_Shard, int, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} of a dataset of {len(self)}")
        position = int(self._select[index]) if self._select is not None else index
        number = bisect.bisect_right(self._first, position) - 1 if len(self._shards) > 1 else 0
        shard = self._shards[number]
        local = position - self._first[number]
        return shard, int(shard.offsets_np[local]), int(shard.offsets_np[local + 1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, start, end = self._locate(index)
        ids = shard.ids[start:end].long()  # a copy: the mapped tokens are never written through
        labels = torch.where(shard.target[start:end] == TRAINED, ids, IGNORE_INDEX)
        return ids, labels

    def sequences(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ids, labels) of each sequence of an example: one, or a preference pair's chosen and rejected."""
        ids, labels = self[index]
        shard, start, end = self._locate(index)
        cuts = [0, *np.flatnonzero(shard.target_np[start:end] == SEQUENCE_START).tolist(), end - start]
        return [(ids[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:])]

    # The flat tensors, as one file holds them. A mixture or a selection has to copy them into memory: fine
    # for tests and small data; training reads examples through [i].
    @property
    def ids(self) -> torch.Tensor:
        return self._flat()[0]

    @property
    def target(self) -> torch.Tensor:
        return self._flat()[1]

    @property
    def offsets(self) -> torch.Tensor:
        return self._flat()[2]

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._select is None and len(self._shards) == 1 and self._shards[0].offsets_np[0] == 0:
            shard = self._shards[0]
            return shard.ids, shard.target, shard.offsets
        content = _Content(keep=True)
        for ids, target, lengths in self.blocks():
            content.add(ids, target, lengths)
        return content.tensors()

    def blocks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(ids, target, lengths) of consecutive examples, a few thousand (or a few million tokens) at a time:
        what save() writes and content_hash() hashes."""
        first = 0
        while first < len(self):
            last, tokens = first, 0
            while last < len(self) and last - first < _EXAMPLES_PER_BLOCK and \
                    (tokens == 0 or tokens + self.lengths[last] <= _TOKENS_PER_BLOCK):
                tokens += self.lengths[last]
                last += 1
            pieces = [shard.tokens(start, end) for shard, start, end in self._spans(first, last)]
            yield (np.concatenate([ids for ids, _ in pieces]), np.concatenate([target for _, target in pieces]),
                   np.array(self.lengths[first:last], dtype=np.int64))
            first = last

    def _spans(self, first: int, last: int) -> list[tuple[_Shard, int, int]]:
        """The token ranges of examples [first, last): one per shard, or, in a selection, one per run of
        examples that follow each other in their shard."""
        if self._select is None:
            spans = []
            for number, shard in enumerate(self._shards):
                start, end = max(first, self._first[number]), min(last, self._first[number + 1])
                if start < end:
                    local = start - self._first[number], end - self._first[number]
                    spans.append((shard, int(shard.offsets_np[local[0]]), int(shard.offsets_np[local[1]])))
            return spans
        spans = []
        for index in range(first, last):
            shard, start, end = self._locate(index)
            if spans and spans[-1][0] is shard and spans[-1][2] == start:
                spans[-1] = (shard, spans[-1][1], end)
            else:
                spans.append((shard, start, end))
        return spans

    def subset(self, indices: list[int]) -> "TokenizedDataset":
        select = np.asarray(indices, dtype=np.int64)
        if len(select) and (select.min() < 0 or select.max() >= len(self)):
            raise IndexError(f"subset of examples {select.min()}..{select.max()} of a dataset of {len(self)}")
        if self._select is not None:
            select = self._select[select]
        return TokenizedDataset._view(self._shards, select, TokenStats(rows=len(indices), kept=len(indices)))

    def token_counts(self) -> tuple[int, int]:
        """(tokens, target tokens) of these examples, counted as TokenStats counts them: the first token of a
        sequence is never a target."""
        tokens = targets = 0
        for ids, target, lengths in self.blocks():
            trained = target == TRAINED  # (a later sequence's first token is SEQUENCE_START, so not counted)
            tokens += len(ids)
            targets += int(trained.sum()) - int(trained[np.cumsum(lengths) - lengths].sum())
        return tokens, targets

    def content_hash(self) -> str:
        """The hash save() writes into the file's metadata (of the examples as one flat file holds them)."""
        content = _Content(keep=False)
        for ids, target, lengths in self.blocks():
            content.add(ids, target, lengths)
        return content.hexdigest()

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, fsync, rename, fsync of the folder) with the content's hash in the
        metadata, so a power cut leaves the old entry or the whole new one, and `load` can check it."""
        with DatasetWriter(path) as writer:
            for ids, target, lengths in self.blocks():
                writer.add(Chunk(ids, target, lengths, TokenStats()))
            writer.finish(self.stats, reopen=False)

    @classmethod
    def load(cls, path: Path, file_sha256: str | None = None) -> "TokenizedDataset":
        """Map a file that save() or a DatasetWriter wrote, after checking it against the content hash in its
        header (or, given `file_sha256`, the hash of the whole file, as a manifest lists it). The check reads the
        file in blocks, through the page cache and not into this process's memory; the tensors are then views of
        a copy-on-write mapping of the same open file. Raises CacheEntryInvalid."""
        try:
            with open(path, "rb") as handle:
                header, data_start, metadata = _read_header(handle)
                if file_sha256 is not None:
                    if _hash_range(handle, 0, os.fstat(handle.fileno()).st_size).hexdigest() != file_sha256:
                        raise CacheEntryInvalid("its bytes do not match the sha256 its manifest lists")
                elif _content_hash_of_file(handle, header, data_start) != metadata["sha256"]:
                    raise CacheEntryInvalid("its content does not match the hash it was written with")
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
                descriptor = os.dup(handle.fileno())  # the same file, for scans (the shard closes it)
        except OSError as exc:
            raise CacheEntryInvalid(f"unreadable ({exc.strerror or exc})") from None
        starts = {name: data_start + header[name]["data_offsets"][0] for name in _LAYOUT}
        tensors = {name: _mapped(mapping, starts[name], header[name]["shape"][0], _LAYOUT[name][1])
                   for name in _LAYOUT}
        shard = _Shard(tensors["ids"], tensors["target"], tensors["offsets"],
                       (descriptor, starts["ids"], starts["target"]))
        offsets = shard.offsets_np
        if offsets[0] != 0 or offsets[-1] != len(shard.ids_np) or not (offsets[1:] > offsets[:-1]).all():
            raise CacheEntryInvalid("its offsets do not cut its tokens into examples")
        return cls._view([shard], None, metadata["stats"])


class CacheEntryInvalid(Exception):
    """A tokenized-cache file that cannot be trusted: it is tokenized again."""


class _Content:
    """Running hashes and lengths of the examples given so far, optionally the examples themselves.

    The content hash covers the layout (dtypes, element counts) and each tensor's own sha256: the ids and target
    hashes can run as examples stream in, though the file puts the offsets (known only at the end) first."""

    def __init__(self, keep: bool):
        self.digests = {"ids": hashlib.sha256(), "target": hashlib.sha256()}
        self.lengths: list[np.ndarray] = []
        self.tokens = 0
        self.kept: dict[str, list[np.ndarray]] | None = {"ids": [], "target": []} if keep else None

    def add(self, ids: np.ndarray, target: np.ndarray, lengths: np.ndarray) -> None:
        for name, array in (("ids", ids), ("target", target)):
            array = np.ascontiguousarray(array, dtype=_LAYOUT[name][1])
            self.digests[name].update(memoryview(array).cast("B"))
            if self.kept is not None:
                self.kept[name].append(array.copy())
        self.lengths.append(np.asarray(lengths, dtype=np.int64))
        self.tokens += len(ids)

    def offsets(self) -> np.ndarray:
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return offsets

    def hexdigest(self, offsets: np.ndarray | None = None) -> str:
        offsets = self.offsets() if offsets is None else offsets
        counts = {"offsets": len(offsets), "ids": self.tokens, "target": self.tokens}
        parts = {"offsets": hashlib.sha256(offsets.tobytes()).digest(),
                 **{name: digest.digest() for name, digest in self.digests.items()}}
        return _combine(counts, parts)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.kept is not None
        ids, target = ([np.zeros(0, dtype=_LAYOUT[name][1])] + self.kept[name] for name in ("ids", "target"))
        return (torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(target)),
                torch.from_numpy(self.offsets()))


def _combine(counts: dict[str, int], digests: dict[str, bytes]) -> str:
    digest = hashlib.sha256(json.dumps({name: [_LAYOUT[name][0], counts[name]] for name in _LAYOUT}).encode())
    for name in _LAYOUT:
        digest.update(digests[name])
    return digest.hexdigest()


class DatasetWriter:
    """Examples appended a chunk at a time as they are tokenized; finish() gives the dataset.

    With a path, tokens go to two temporary files beside it as they come, so memory stays flat however many rows
    there are (the offsets, 8 bytes an example, wait in memory: the file puts them first), and finish() writes
    the safetensors file atomically and maps it back. Without a path the examples are kept in memory."""

    def __init__(self, path: Path | None):
        self.path = path
        self.stats = TokenStats()
        self._content = _Content(keep=path is None)
        self._spill: dict[str, tuple[Path, object]] = {}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            for name in ("ids", "target"):
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".{name}.tmp")
                self._spill[name] = (Path(tmp), os.fdopen(fd, "wb"))

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Remove the temporary files (finish() has copied them into the entry by then)."""
        for tmp, handle in self._spill.values():
            handle.close()
            tmp.unlink(missing_ok=True)
        self._spill = {}

    def add(self, chunk: Chunk) -> None:
        self.stats.add(chunk.stats)
        self._content.add(chunk.ids, chunk.target, chunk.lengths)
        for name in self._spill:
            self._spill[name][1].write(memoryview(np.ascontiguousarray(getattr(chunk, name),
                                                                       dtype=_LAYOUT[name][1])).cast("B"))

    def finish(self, stats: TokenStats | None = None, reopen: bool = True) -> TokenizedDataset | None:
        """The examples as a dataset (mapped from the file just written, when there is a path). `stats`: the
        dataset's stats when they are not the sum of the chunks' (a saved dataset)."""
        stats = stats or self.stats
        if self.path is None:
            return TokenizedDataset(*self._content.tensors(), stats)
        offsets = self._content.offsets()
        metadata = {"stats": json.dumps(stats.__dict__), "sha256": self._content.hexdigest(offsets)}
        counts = {"offsets": len(offsets), "ids": self._content.tokens, "target": self._content.tokens}
        with atomic_file(self.path) as tmp, open(tmp, "wb") as out:
            out.write(_header(counts, metadata))
            out.write(offsets.tobytes())
            for name in ("ids", "target"):
                spill, handle = self._spill[name]
                handle.flush()
                with open(spill, "rb") as source:
                    shutil.copyfileobj(source, out, _BLOCK)
        self.close()
        return TokenizedDataset.load(self.path) if reopen else None


def _header(counts: dict[str, int], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    start = 0
    for name, (dtype, np_dtype) in _LAYOUT.items():
        size = counts[name] * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": dtype, "shape": [counts[name]], "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)  # safetensors pads with spaces; the data starts 8-aligned
    return struct.pack("<Q", len(text)) + text


def _read_header(handle) -> tuple[dict, int, dict]:
    """The tensors' entries, where the data starts, and the metadata (stats parsed), checked for shape."""
    size = os.fstat(handle.fileno()).st_size
    raw = handle.read(8)
    if len(raw) < 8:
        raise CacheEntryInvalid(f"it is {size} bytes long: no safetensors header")
    length = struct.unpack("<Q", raw)[0]
    if length > min(_MAX_HEADER, size - 8):
        raise CacheEntryInvalid(f"its header length ({length}) does not fit the file ({size} bytes)")
    try:
        header = json.loads(handle.read(length))
        metadata = header.pop("__metadata__")
        metadata["stats"] = TokenStats(**json.loads(metadata["stats"]))
        if not isinstance(metadata["sha256"], str):
            raise TypeError("sha256 is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CacheEntryInvalid(f"its header is not a gpupoor tokenized file ({type(exc).__name__}: {exc})") from None
    data_start, end = 8 + length, 0
    if sorted(header) != sorted(_LAYOUT):
        raise CacheEntryInvalid(f"it holds {', '.join(sorted(header))}, not {', '.join(_LAYOUT)}")
    for name, (dtype, np_dtype) in _LAYOUT.items():
        entry = header[name] if isinstance(header[name], dict) else {}
        shape = entry.get("shape")
        count = shape[0] if isinstance(shape, list) and len(shape) == 1 else None
        if entry.get("dtype") != dtype or not isinstance(count, int) or count < (1 if name == "offsets" else 0) \
                or entry.get("data_offsets") != [end, end + count * np.dtype(np_dtype).itemsize]:
            raise CacheEntryInvalid(f"its {name} entry is malformed: {entry}")
        end += count * np.dtype(np_dtype).itemsize
    if header["ids"]["shape"] != header["target"]["shape"]:
        raise CacheEntryInvalid(f"its ids and target entries differ in shape ({header['ids']['shape']}, "
                                f"{header['target']['shape']})")
    if data_start + end != size:
        what = "truncated" if size < data_start + end else "longer than its tensors"
        raise CacheEntryInvalid(f"the file is {size} bytes, its header describes {data_start + end}: {what}")
    return header, data_start, metadata


def _hash_range(handle, start: int, length: int):
    digest = hashlib.sha256()
    handle.seek(start)
    while length > 0:
        block = handle.read(min(_BLOCK, length))
        if not block:
            raise CacheEntryInvalid("it ended while being read")
        digest.update(block)
        length -= len(block)
    return digest


def _content_hash_of_file(handle, header: dict, data_start: int) -> str:
    digests = {}
    for name in _LAYOUT:
        begin, end = header[name]["data_offsets"]
        digests[name] = _hash_range(handle, data_start + begin, end - begin).digest()
    return _combine({name: header[name]["shape"][0] for name in _LAYOUT}, digests)


def _mapped(mapping: mmap.mmap, offset: int, count: int, np_dtype) -> torch.Tensor:
    if count == 0:
        return torch.zeros(0, dtype=_TORCH[np_dtype])
    # The mapping is copy-on-write (ACCESS_COPY), so torch gets a writable buffer and the file is never changed;
    # the tensor keeps the mapping alive.
    return torch.frombuffer(mapping, dtype=_TORCH[np_dtype], count=count, offset=offset)


def concat_datasets(datasets: list[TokenizedDataset]) -> TokenizedDataset:
    """Examples of several datasets end to end (one dataset: itself), stats summed. A view: nothing is copied."""
    if len(datasets) == 1:
        return datasets[0]
    shards: list[_Shard] = []
    selects: list[np.ndarray] = []
    selected = any(d._select is not None for d in datasets)
    for dataset in datasets:
        if selected:
            own = dataset._select if dataset._select is not None else np.arange(dataset._first[-1])
            selects.append(own + _examples(shards))
        shards += dataset._shards
    stats = TokenStats()
    for dataset in datasets:
        stats.add(dataset.stats)
    return TokenizedDataset._view(shards, np.concatenate(selects) if selected else None, stats)


def _examples(shards: list[_Shard]) -> int:
    return sum(len(shard) for shard in shards)


def tokenize_rows(rows: list[Row], encoder: Encoder) -> TokenizedDataset:
    """Rows encoded one by one, in memory: the reference the streamed, batched path (gpupoor.data.tokenize)
    must equal."""
    writer = DatasetWriter(None)
    writer.add(encoded_chunk([encoder.encode(row.fields, row.where) for row in rows]))
    return writer.finish()


def tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    digest.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer("a").input_ids)).encode())
    return digest.hexdigest()


def data_identity(data_fingerprint: str, tokenizer, encoder: Encoder) -> str:
    """What the tokenized data is: the rows' bytes, the tokenizer and every setting that changes what a row
    becomes. Checkpoints record it and resume compares it, so it must not change when only the cache's file
    layout does (CACHE_VERSION): the settings hash as the first cache version hashed them, and a setting added
    since enters only when it holds something (it did not exist before)."""
    settings = encoder.cache_settings()
    hashed = {"version": "1", **{key: settings[key] for key in ("format", "max_length", "train_on_prompt",
                                                                "text_field", "messages_field", "template")}}
    hashed.update({key: value for key, value in settings.items() if key not in hashed and value is not None})
    digest = hashlib.sha256(data_fingerprint.encode())
    digest.update(tokenizer_fingerprint(tokenizer).encode())
    digest.update(json.dumps(hashed, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def cache_key(identity: str) -> str:
    """The cache entry's file name: the data's identity in this cache layout."""
    return hashlib.sha256(f"{identity}:cache-v{CACHE_VERSION}".encode()).hexdigest()[:32]
