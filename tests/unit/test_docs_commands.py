"""Every `gpupoor ...` command line in the README's and docs' code blocks names a command and options that exist:
each is parsed by the CLI itself (with --help appended, so nothing runs). A renamed option or verb fails here
before a reader copies it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpupoor.cli import app

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def command_lines() -> list[tuple[str, str]]:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in FENCE.findall(doc.read_text()):
            for line in block.splitlines():
                line = re.sub(r"^\$ ", "", line.strip())
                line = line.split(" #")[0].split("  # ")[0].strip().split(" | ")[0].split(" > ")[0]
                verb = line.split()[1] if len(line.split()) > 1 else ""
                if line.startswith("gpupoor ") and not verb.endswith(":") and "..." not in line and "\\" not in line:
                    found.append((f"{doc.name}: {line}", line))
    return found


COMMANDS = command_lines()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("where,line", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_parses(where, line):
    words = shlex.split(line)[1:]
    result = CliRunner().invoke(app, [*words, "--help"], terminal_width=200)
    assert result.exit_code == 0, f"{where}\n{result.output}"
