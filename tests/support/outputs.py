"""Shared by the outputs tests (moved from integration/test_outputs.py, whose tests still use them)."""

from __future__ import annotations

import re


# What a type cell of docs/recipe.md may contain: type names, quoted literals, numbers, null, brackets.
TYPE_TOKEN = re.compile(r'\s*(?:\\\||\[|\]|,|bool|int|float|str|list|tuple|dict|mapping|null|true|false|-?\d+|"[^"|]*")\s*')


def _type_cells(reference: str) -> dict[str, str]:
    cells = {}
    for line in reference.splitlines():
        match = re.match(r"\| `([\w.\[\]]+)` \| (.*?) \| ", line)
        if match:
            cells[match.group(1)] = match.group(2)
    return cells
