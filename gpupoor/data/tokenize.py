"""Rows -> a tokenized dataset, streamed and in parallel; and the directory `gpupoor tokenize` writes.

Streamed: rows are read, encoded and written a chunk at a time (gpupoor.data.dataset.DatasetWriter), so memory
stays flat however many rows a source has. Parallel: after the first chunk, chunks are encoded in worker
processes, one per core this process may use. A pool of processes rather than the fast tokenizer's own threads
on batched calls: the threads parallelize only the Rust encoding, and what is left (rendering rows, assembling
ids and labels, in Python) stays serial. A first measurement on a 2-core machine that other work shared (50k alpaca
rows of ~110 tokens, read and encoded): 2 worker processes 7.6-8.9k rows/s, one process with the tokenizer's
threads 6.3-6.5k, one thread 5.4k; bench/data_scaling.py --strategies repeats it on a quiet machine.

Within a chunk every segment of every row goes to the tokenizer in one call (encode_rows), then each row's ids and
labels are joined by the assembly Encoder.encode uses (gpupoor.data.assembly); a test holds the two equal, token
for token.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from gpupoor.data.dataset import (CacheEntryInvalid, Chunk, DatasetWriter, TokenizedDataset, TokenStats,
                                  encoded_chunk, tokenizer_fingerprint)
from gpupoor.data.assembly import Encoded, assemble
from gpupoor.data.encoder import Encoder
from gpupoor.data.loading import DataSource, Row, iter_rows
from gpupoor.data.mixture import Mixture, Source
from gpupoor.data.tokenized_manifest import DIR_KIND, DIR_VERSION, MANIFEST, REDO_HINT, read_manifest
from gpupoor import faults
from gpupoor.errors import UserError
from gpupoor.storage.files import atomic_dir, blocking_file, sha256_file, why_not_written

CHUNK_ROWS = 1000  # rows encoded together: one tokenizer call, one task for a worker
PROGRESS_AFTER_ROWS = 50_000  # a progress line for sources at least this long

TRAIN_FILE, EVAL_FILE = "train.safetensors", "eval.safetensors"


def tokenize_source(location: DataSource, limit: int | None, encoder: Encoder, tokenizer, cache_path: Path | None,
                    warnings: list[str]) -> tuple[TokenizedDataset, bool]:
    """One source's examples and whether they came from the cache. `cache_path`: the cache entry (None: no
    cache). An entry that fails its check is a miss with a warning; a cache that cannot be written is a warning
    and the examples are kept in memory. `tokenizer` is the encoder's (the caller keys the entry with it)."""
    if cache_path is not None and cache_path.is_file():
        try:
            return TokenizedDataset.load(cache_path), True
        except CacheEntryInvalid as exc:  # a miss: tokenize again and replace the entry
            warnings.append(f"tokenized cache entry {cache_path} is invalid ({exc}): tokenizing the data again")
    if cache_path is not None:
        try:
            return stream_tokenize(iter_rows(location, limit), encoder, cache_path, _label(location)), False
        except OSError as exc:  # a cache that cannot be written costs time next run, never this run
            remove = ": remove it, or" if blocking_file(cache_path.parent) else ";"
            warnings.append(f"could not write the tokenized cache {cache_path} ({why_not_written(exc, cache_path.parent)}"
                            f"{remove} set data.cache_dir or $GPUPOOR_CACHE to a writable folder)")
    return stream_tokenize(iter_rows(location, limit), encoder, None, _label(location)), False


def stream_tokenize(rows: Iterable[Row], encoder: Encoder, path: Path | None, label: str = "data",
                    workers: int | None = None) -> TokenizedDataset:
    """Rows encoded chunk by chunk into `path` (mapped back when done), or into memory when `path` is None."""
    progress = Progress(label)
    with DatasetWriter(path) as writer:
        for chunk in encode_chunks(rows, encoder, workers):
            writer.add(chunk)
            progress.update(writer.stats.rows)
        progress.update(writer.stats.rows, final=True)
        return writer.finish()


def encode_chunks(rows: Iterable[Row], encoder: Encoder, workers: int | None = None) -> Iterator[Chunk]:
    """Chunks of CHUNK_ROWS rows, in order. The first is encoded here; when there are more, `workers` processes
    (default: the cores this process may use, shared with the other processes of this node) encode the rest."""
    workers = workers or usable_workers()
    batches = _batched(rows, CHUNK_ROWS)
    first, second = next(batches, None), next(batches, None)
    if first is None:
        return
    yield encode_chunk(first, encoder)
    if second is None:
        return
    rest = itertools.chain([second], batches)
    if workers < 2 or not _can_fork():
        for batch in rest:
            yield encode_chunk(batch, encoder)
        return
    yield from _pooled(rest, encoder, workers)


def _pooled(batches: Iterator[list[Row]], encoder: Encoder, workers: int) -> Iterator[Chunk]:
    # Fork: the workers inherit the encoder (tokenizer, template) instead of unpickling one each, and start in
    # milliseconds. Only rows and encoded chunks cross the pipes (pickled, between our own processes).
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker,
                               initargs=(encoder,))
    try:
        # A bounded number of chunks in flight: submitting as fast as rows are read would queue the whole file.
        pending: collections.deque[Future] = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= 2 * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_WORKER_ENCODER: Encoder | None = None


def _start_worker(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: the pool is the parallelism
    # The parent decides when to stop (train turns SIGTERM into a checkpoint); it shuts the pool down, and a worker
    # whose parent died sees its task pipe close and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _encode_in_worker(batch: list[Row]) -> Chunk | tuple[str, str | None]:
    try:
        return encode_chunk(batch, _WORKER_ENCODER)
    except UserError as exc:  # sent back as text: pickling the exception would lose its hint
        return exc.message, exc.hint


def _result(future: Future) -> Chunk:
    value = future.result()
    if isinstance(value, tuple):
        raise UserError(value[0], hint=value[1])
    return value


def encode_chunk(rows: list[Row], encoder: Encoder) -> Chunk:
    return encoded_chunk(encode_rows(rows, encoder))


def encode_rows(rows: list[Row], encoder: Encoder) -> list[Encoded]:
    """What [encoder.encode(row) for row in rows] returns, with one tokenizer call for all the rows' segments
    (a fast tokenizer encodes a batch with far less overhead than one call per segment). A format whose encode
    is not its segments assembled (`tokenized`, `preference`: Format.batched) is encoded row by row."""
    if not encoder.format.batched or not rows:
        return [encoder.encode(row.fields, row.where) for row in rows]
    segments = [encoder.segments(row.fields, row.where) for row in rows]
    encoded = [assemble(encoder, pieces, ids) for pieces, ids in zip(segments, encoder.segments_ids(segments))]
    # Should a format encode otherwise than its segments assembled yet be marked batched, or a tokenizer's batched
    # call differ from its single calls: a chunk whose first row differs from Encoder.encode is encoded row by row
    # (slower, never wrong).
    if encoded[0] != encoder.encode(rows[0].fields, rows[0].where):
        return [encoder.encode(row.fields, row.where) for row in rows]
    return encoded


def usable_workers() -> int:
    """The cores this process may use (its affinity), shared with the other processes of this node."""
    from gpupoor.hardware import usable_cpu_count

    return max(1, usable_cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _can_fork() -> bool:
    # Forking a process that holds other libraries' threads is safe on Linux for what the workers do (Python and
    # the tokenizer only); macOS system libraries are not fork-safe, so there the chunks are encoded here.
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _batched(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    iterator = iter(rows)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _label(location: DataSource) -> str:
    return Path(location.location).name if location.kind != "hub" else location.location


class Progress:
    """A line on stderr while a long source is tokenized: from PROGRESS_AFTER_ROWS rows on, redrawn at most every
    second on a terminal (every 30 s into a log), by the first process of a distributed run only."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream = label, stream or sys.stderr
        self.started = time.monotonic()
        self.shown_at: float | None = None
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.quiet = int(os.environ.get("RANK", "0")) != 0

    def update(self, rows: int, final: bool = False) -> None:
        if self.quiet or rows < PROGRESS_AFTER_ROWS:
            return
        now = time.monotonic()
        if not final and self.shown_at is not None and now - self.shown_at < (1 if self.tty else 30):
            return
        self.shown_at = now
        line = f"tokenizing {self.label}: {rows:,} rows, {rows / max(now - self.started, 1e-9):,.0f} rows/s"
        if final:
            line += f", done in {now - self.started:.1f} s"
        self.stream.write(f"\r{line}" + ("\n" if final else "") if self.tty else f"{line}\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------------------------
# The directory `gpupoor tokenize` writes and data.tokenized_path reads


def tokenizer_facts(tokenizer) -> dict:
    """What a tokenized directory records of its tokenizer: the fingerprint decides, the rest names a difference."""
    return {"fingerprint": tokenizer_fingerprint(tokenizer), "name_or_path": getattr(tokenizer, "name_or_path", ""),
            "class": type(tokenizer).__name__, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}


def write_tokenized_dir(output: Path, bundle, data, tokenizer, seed: int) -> dict:
    """Write `output` atomically: `bundle` (a gpupoor.data.build.DataBundle built from the recipe's `data`
    section) as train.safetensors (and eval.safetensors) and a manifest.json listing every file's size and
    sha256, the data and tokenizer fingerprints, the data settings, the mixture and the sources' stats. An
    existing `output` is replaced only when it is an earlier tokenized directory. Returns the manifest."""
    _check_output(output)
    manifest = {
        "kind": DIR_KIND, "version": DIR_VERSION,
        "data_fingerprint": bundle.fingerprint,
        "tokenizer": tokenizer_facts(tokenizer),
        "max_length": data.max_length,
        "data": data.model_dump(mode="json"),
        "sources": [source.model_dump(mode="json") for source in data.sources()],
        "mixture": {"seed": seed, "sources": [asdict(source) for source in bundle.mixture.sources]}
        if bundle.mixture is not None else None,
        "source_stats": [asdict(stats) for stats in bundle.source_stats],
        "train": {"examples": len(bundle.train), "stats": asdict(bundle.train.stats)},
        "eval": {"examples": len(bundle.eval), "stats": asdict(bundle.eval.stats)} if bundle.eval is not None else None,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name names the host too: nodes sharing a filesystem may have the same process ids.
    with atomic_dir(output, f".{output.name}.tmp-{socket.gethostname()}-{os.getpid()}") as tmp:
        files = {}
        for name, dataset in ((TRAIN_FILE, bundle.train), (EVAL_FILE, bundle.eval)):
            if dataset is not None:
                dataset.save(tmp / name)
                faults.at_stage("working")  # tests: a signal with the temporary folder half written
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        manifest["files"] = files
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not _written_by_tokenize(output):
        raise UserError(f"--output {output}: a directory with other files in it; gpupoor tokenize replaces only "
                        "an empty directory or one it wrote", hint="give a new directory")


def _written_by_tokenize(directory: Path) -> bool:
    """Its manifest says `gpupoor tokenize` wrote it (a run's final/ or a checkpoint has a manifest too)."""
    try:
        return json.loads((directory / MANIFEST).read_text(encoding="utf-8")).get("kind") == DIR_KIND
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenized_dir(path: Path, tokenizer) -> tuple[TokenizedDataset, TokenizedDataset | None, dict]:
    """(train, eval or None, manifest) from a directory `gpupoor tokenize` wrote, after checking that `tokenizer`
    is the one it was tokenized with and that every file matches the size and sha256 the manifest lists (each file
    is read once, in blocks; the datasets are then memory-mapped, read-only on disk: several runs and nodes can
    share the directory). A difference is a UserError that names it."""
    manifest = read_manifest(path)
    _check_tokenizer(manifest["tokenizer"], tokenizer, path)
    datasets: dict[str, TokenizedDataset] = {}
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise UserError(f"data.tokenized_path: {file} is missing (its manifest lists it)", hint=REDO_HINT)
        if file.stat().st_size != entry["size"]:
            raise UserError(f"data.tokenized_path: {file} is {file.stat().st_size} bytes; its manifest says "
                            f"{entry['size']}: the directory is damaged or was changed", hint=REDO_HINT)
        try:
            datasets[name] = TokenizedDataset.load(file, file_sha256=entry["sha256"])
        except CacheEntryInvalid as exc:
            raise UserError(f"data.tokenized_path: {file} does not match {path / MANIFEST}: {exc}; the directory "
                            "is damaged or was changed after gpupoor tokenize wrote it", hint=REDO_HINT) from None
    train, evaluation = datasets.get(TRAIN_FILE), datasets.get(EVAL_FILE)
    if train is None or len(train) != manifest["train"]["examples"]:
        raise UserError(f"data.tokenized_path: {path} has no training examples as its manifest lists them",
                        hint=REDO_HINT)
    return train, evaluation, manifest


def _check_tokenizer(recorded: dict, tokenizer, path: Path) -> None:
    current = tokenizer_facts(tokenizer)
    if current["fingerprint"] == recorded.get("fingerprint"):
        return
    differences = [f"{key} {recorded.get(key)} there, {current[key]} here"
                   for key in ("vocab_size", "bos_token_id", "eos_token_id") if recorded.get(key) != current[key]]
    what = "; ".join(differences) or "the same size and special tokens, but other vocabulary, merges or rules"
    names = recorded.get("name_or_path") or "unnamed", current["name_or_path"] or "unnamed"
    raise UserError(f"data.tokenized_path: {path} was tokenized with another tokenizer ({what}; it was "
                    f"{names[0]}, this model's is {names[1]})",
                    hint="token ids only mean something to the tokenizer that made them: tokenize the data again "
                    "with this model's recipe, or train the model it was tokenized for")


def manifest_mixture(manifest: dict, seed: int) -> Mixture | None:
    """The mixture a tokenized directory holds (its sources' places and amounts), drawn with the run's seed."""
    mixture = manifest.get("mixture")
    try:
        return Mixture([Source(**source) for source in mixture["sources"]], seed) if mixture else None
    except (TypeError, KeyError) as exc:
        raise UserError(f"data.tokenized_path: its manifest's mixture is not readable ({exc})", hint=REDO_HINT) from None


def manifest_source_stats(manifest: dict) -> list[TokenStats]:
    try:
        return [TokenStats(**stats) for stats in manifest.get("source_stats", [])]
    except TypeError as exc:
        raise UserError(f"data.tokenized_path: its manifest's source stats are not readable ({exc})",
                        hint=REDO_HINT) from None
