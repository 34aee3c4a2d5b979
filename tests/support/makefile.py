"""The Makefile's demo targets as the real tier reads them, so its tests cannot drift from the demos."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def target_commands(target: str) -> tuple[list[str], list[str]]:
    """The words after `gpupoor train` and after `gpupoor eval` in the Makefile's `target` (one of each)."""
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile has a {target} target"
    commands = [shlex.split(line) for line in found.group(1).splitlines()]
    gpupoor = [words for words in commands if words[0].endswith("/bin/gpupoor")]
    train = [words[2:] for words in gpupoor if words[1] == "train"]
    evaluate = [words[2:] for words in gpupoor if words[1] == "eval"]
    assert len(train) == len(evaluate) == 1, f"one train and one eval command in {target}: {commands}"
    return train[0], evaluate[0]
