"""Read raw rows from local files, saved datasets or the hub, each row tagged with where it came from."""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.storage.files import hash_file_into
from gpupoor.recipe.loading import DATA_SUFFIXES, decode_utf8, resolve_local_path

PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a batch, not the file, is in memory
# JSON may escape a UTF-16 surrogate (\ud800-\udfff): a high one followed by a low one is one character (an emoji),
# a lone one decodes to a str that is no Unicode text, which a tokenizer cannot encode (a TypeError naming no row).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # cheap test: only JSON text that has one is searched
_JSON_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Row:
    fields: dict
    where: str  # "file:line" (or "dataset[index]") for error messages


@dataclass
class DataSource:
    """A resolved data location: a local file, a `save_to_disk` directory, or a hub dataset name."""

    kind: str  # "file" | "disk" | "hub"
    location: str
    split: str

    def fingerprint(self) -> str:
        """Identity of the data bytes, for the tokenization cache key."""
        digest = hashlib.sha256(f"{self.kind}:{self.split}".encode())
        if self.kind == "file":
            hash_file_into(digest, Path(self.location))
        elif self.kind == "disk":
            for path in sorted(Path(self.location).rglob("*")):
                if path.is_file():
                    digest.update(str(path.relative_to(self.location)).encode())
                    hash_file_into(digest, path)
        else:
            digest.update(_load_hub(self)._fingerprint.encode())
        return digest.hexdigest()


def resolve_source(value: str, base_dir: Path, split: str, key: str) -> DataSource:
    local = resolve_local_path(value, base_dir, DATA_SUFFIXES)
    if local is None:
        return DataSource("hub", value, split)
    if local.is_dir():
        return DataSource("disk", str(local), split)
    if local.exists() and not local.is_file():  # a FIFO, socket or device: reading it would block or fail
        raise UserError(f"{key}: {local} is not a regular file (it is a FIFO, socket or device)",
                        hint="point it at a .jsonl/.json/.csv/.parquet file or a datasets.save_to_disk directory")
    if not local.is_file():
        raise UserError(f"{key}: data file not found: {local}",
                        hint="relative paths resolve against the recipe file's directory")
    if local.suffix.lower() not in DATA_SUFFIXES:
        raise UserError(f"{key}: unsupported data file {local.name}; use one of {', '.join(DATA_SUFFIXES)}, "
                        "a datasets.save_to_disk directory or a hub dataset name")
    return DataSource("file", str(local), split)


def check_held_out(prefix: str, eval_rows: int, available: int, counted: str) -> None:
    """`{prefix}.eval_rows` must leave training rows: validate counts the source's rows, training its usable
    examples (`counted` says which, e.g. "the data has 40 usable examples")."""
    if eval_rows >= available:
        raise UserError(f"{prefix}.eval_rows = {eval_rows} leaves no training rows ({counted})",
                        hint=f"hold out fewer rows (at most {max(available - 1, 0)}), or give {prefix}.eval_path: a "
                        "separate eval file")


def read_rows(source: DataSource, limit: int | None = None) -> list[Row]:
    """All rows (or the first `limit`) as dicts. Malformed input is a UserError naming file:line."""
    return list(iter_rows(source, limit))


def iter_rows(source: DataSource, limit: int | None = None) -> Iterator[Row]:
    """The rows one at a time, so a caller that tokenizes as it reads holds a chunk, never the whole file.
    .jsonl, .csv, .parquet and saved or hub datasets stream; a .json list is parsed whole (JSON has no
    record boundaries to stop at), so data bigger than memory belongs in .jsonl."""
    if source.kind == "file":
        path = Path(source.location)
        suffix = path.suffix.lower()
        reader = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}.get(suffix, _read_parquet)
        try:
            yield from reader(path, limit)
        except UnicodeDecodeError:
            # The text readers decode in blocks, so the error's offset is not the file's: find it in the bytes.
            decode_utf8(path, path.read_bytes())
            raise
        except OSError as exc:
            raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
        return
    dataset = _load_disk(source) if source.kind == "disk" else _load_hub(source)
    count = len(dataset) if limit is None else min(limit, len(dataset))
    # Iterating reads the Arrow table in batches (memory-mapped for saved and hub datasets); dataset[i] would
    # be the same rows at a much higher cost per row.
    for index, record in enumerate(itertools.islice(dataset, count)):
        yield Row(dict(record), f"{source.location}[{index}]")


def _read_jsonl(path: Path, limit: int | None) -> Iterator[Row]:
    with open(path, encoding="utf-8") as handle:
        yield from jsonl_rows(enumerate(handle, 1), str(path), limit)


def jsonl_rows(lines: Iterable[tuple[int, str]], name: str, limit: int | None = None) -> Iterator[Row]:
    """The rows of JSONL text, given as (line number, line); errors name `name:LINE` (a file, or `<stdin>`)."""
    count = 0
    for line_no, line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{name}:{line_no}: not valid JSON: {exc.msg} (column {exc.colno})",
                            hint="each line of a .jsonl file is one JSON object") from None
        if not isinstance(value, dict):
            raise UserError(f"{name}:{line_no}: expected a JSON object, got {type(value).__name__}")
        if _SURROGATE_ESCAPE.search(line):
            _refuse_lone_surrogate(value, line, f"{name}:{line_no}")
        yield Row(value, f"{name}:{line_no}")
        count += 1
        if limit is not None and count >= limit:
            return


def _read_json(path: Path, limit: int | None) -> Iterator[Row]:
    text: str | None = path.read_text(encoding="utf-8")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if not _SURROGATE_ESCAPE.search(text):
        text = None  # kept only to find a lone surrogate's line: otherwise the rows alone stay in memory
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))  # {"train": [...]} or {"data": [...]}
    if not isinstance(value, list):
        raise UserError(f"{path}: expected a JSON list of objects")
    for index, item in enumerate(value[:limit] if limit else value):
        if not isinstance(item, dict):
            raise UserError(f"{path}: item {index}: expected a JSON object, got {type(item).__name__}")
        if text is not None:
            _refuse_lone_surrogate(item, text, str(path), index)
        yield Row(item, f"{path}[{index}]")


def _refuse_lone_surrogate(value, text: str, where: str, item: int | None = None) -> None:
    """A UserError naming file:line, the column and the field when a decoded JSON row holds a lone surrogate.
    `text` is the JSON the row came from (a .jsonl line, where `where` names its line; or a whole .json file)."""
    field = _lone_surrogate_field(value)
    if field is None:
        return
    offset = _lone_escape_offset(text)
    line = text.count("\n", 0, offset)
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    if item is not None:  # a .json file: `where` is the file, the line is counted in it
        where = f"{where}:{line + 1} (item {item})"
    raise UserError(f"{where}: {field}: {text[offset:offset + 6]} (column {column}) is half of a UTF-16 surrogate "
                    "pair with no other half: JSON allows the escape, but it is no character and no tokenizer can "
                    "encode it", hint="write the whole character (both escapes, e.g. \\ud83d\\ude00, or the "
                    "character itself) or drop the row; the tool that wrote the file may have cut a string "
                    "mid-character")


def _lone_surrogate_field(value, name: str = "") -> str | None:
    """The field (`messages[1].content`) of the first string in a decoded JSON value that holds a lone surrogate.
    A key holding one is named by where it is: the name itself cannot be printed."""
    if isinstance(value, str):
        return (name or "the row") if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return f"a key of {name or 'the row'}"
        found = _lone_surrogate_field(item, f"{name}[{key}]" if isinstance(key, int) else f"{name}.{key}" if name
                                      else key)
        if found is not None:
            return found
    return None


def _lone_escape_offset(text: str) -> int:
    """Where the first escape of a lone surrogate is in JSON text. Escapes are read in order, so an escaped
    backslash followed by `ud800` is no surrogate, and a high half is lone unless a low half follows at once."""
    high = None  # the offset of a high half waiting for its low half
    for match in _JSON_ESCAPE.finditer(text):
        code = int(match.group(1), 16) if match.group(1) else -1
        if high is not None:
            if match.start() != high + 6 or not 0xDC00 <= code <= 0xDFFF:
                return high
            high = None
        elif 0xD800 <= code <= 0xDBFF:
            high = match.start()
        elif 0xDC00 <= code <= 0xDFFF:
            return match.start()
    return high if high is not None else 0


def _read_csv(path: Path, limit: int | None) -> Iterator[Row]:
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        for count, record in enumerate(reader, 1):
            yield Row(dict(record), f"{path}:{reader.line_num}")
            if limit is not None and count >= limit:
                return


def _read_parquet(path: Path, limit: int | None) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        index = 0
        for batch in batches:
            try:
                records = batch.to_pylist()
            except UnicodeDecodeError:
                raise _undecodable_row(path, batch, index) from None
            for record in records:
                if limit is not None and index >= limit:
                    return
                yield Row(record, f"{path}[{index}]")
                index += 1
    except UserError:
        raise
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise UserError(f"{path}: cannot read parquet: {exc}") from None


def _undecodable_row(path: Path, batch, first: int) -> UserError:
    """The row and column of a batch whose string holds bytes that are not UTF-8 (pyarrow checks them on write,
    other writers may not; a lone surrogate written as CESU-8 is one)."""
    for row in range(batch.num_rows):
        for name in batch.schema.names:
            try:
                batch.slice(row, 1).column(name).to_pylist()
            except UnicodeDecodeError as exc:
                return UserError(f"{path}[{first + row}]: {name}: not UTF-8 text: {exc.reason} at byte {exc.start} "
                                 "of the value", hint="write the column again as UTF-8 text, or drop the row")
    return UserError(f"{path}: rows {first} to {first + batch.num_rows - 1} are not UTF-8 text")


def _load_disk(source: DataSource):
    import datasets

    try:
        dataset = datasets.load_from_disk(source.location)
    except Exception as exc:
        raise UserError(f"{source.location}: not a dataset saved with save_to_disk: {exc}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if source.split not in dataset:
            raise UserError(f"{source.location}: no split {source.split!r}; it has {', '.join(dataset)}",
                            hint="set data.split")
        dataset = dataset[source.split]
    return dataset


def _load_hub(source: DataSource):
    import datasets

    try:
        return datasets.load_dataset(source.location, split=source.split)
    except Exception as exc:
        raise UserError(f"data: cannot load hub dataset {source.location!r} (split {source.split!r}): {exc}",
                        hint="check the name and network, or point data.path at a local file") from None


def decode_line(raw: bytes, where: str) -> str:
    """One line of standard input as text; a UserError naming `where` (`<stdin>:LINE`) when its bytes are not
    UTF-8, or hold a NUL byte (binary data: no prompt has one, and the tokenizer would take it as text)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line "
                        f"({exc.reason})", hint="give prompts as UTF-8 text (e.g. through `iconv -f latin1 -t "
                        "utf-8`)") from None
    if "\0" in text:
        raise UserError(f"{where}: a NUL byte at byte {raw.index(0) + 1} of the line: binary data, not text",
                        hint="give prompts as text: one per line, or JSONL rows") from None
    return text
