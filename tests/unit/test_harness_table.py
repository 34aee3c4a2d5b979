"""The bad-input harness's table (tests/support/harness.py) lists every verb of `gpupoor --help` and every option
and argument each takes: a verb or option added without its entry fails here, so it joins the harness (and its
bad values are tried in tests/integration/test_harness.py) the day it lands."""

from __future__ import annotations

from pathlib import Path

import typer.main

from gpupoor.cli import app
from support.harness import VERBS, cases, command_line, World


def parameters(command) -> set[str]:
    """An option by its first name (--output), an argument by its metavar (typer's upper-cased name)."""
    return {p.opts[0] if p.param_type_name == "option" else p.name.upper() for p in command.params}


def test_every_verb_and_every_option_has_an_entry():
    commands = typer.main.get_command(app).commands
    assert sorted(VERBS) == sorted(commands), "a verb of gpupoor --help without its entry in the harness, or one gone"
    for name, command in commands.items():
        assert sorted(VERBS[name].options) == sorted(parameters(command)), name


def test_the_harness_has_hundreds_of_cases_and_each_changes_one_part(tmp_path):
    """The count docs/cli.md states; and a case's command line is the verb's good one with one part swapped."""
    assert len(cases()) >= 300
    signalled = sum(3 for entry in VERBS.values() if entry.signals)
    cli_doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert f"each of the **{len(cases())} cases**" in cli_doc and f"inside its work (**{signalled} cases**)" in cli_doc
    world = World(tmp_path, tmp_path / "r.yaml", tmp_path / "run", tmp_path / "rows.jsonl", tmp_path / "lf.yaml")
    assert command_line("merge-lora", "--output", "BAD", world)[:4] == ["merge-lora", str(world.run), "--output", "BAD"]
    assert command_line("merge-lora", "SOURCE", "BAD", world)[:2] == ["merge-lora", "BAD"]
    assert command_line("merge-lora", "--dtype", "BAD", world)[-2:] == ["--dtype", "BAD"]
