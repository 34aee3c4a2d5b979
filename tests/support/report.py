"""Shared by the report tests (moved from integration/test_report.py, whose tests still use them)."""

from __future__ import annotations

from pathlib import Path


# Lines of metrics.jsonl that are not records: what a hand edit or a disk error leaves (#25).
BAD_LINES = {"null": b"null", "list": b"[1, 2]", "string": b'"a string"', "binary": b"\xff\xfe\x00garbage",
             "no step": b'{"loss": 1.5}', "by source": b'{"step": 2, "examples_by_source": 3}'}


def insert_bad_line(run: Path, line: bytes, at: int = 3) -> None:
    """Put `line` at line number `at` of the run's metrics.jsonl."""
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines[:at - 1] + [line + b"\n"] + lines[at - 1:]))
