"""The CLI surface: validate, schema, --version, output modes, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from gpupoor import __version__
from gpupoor.cli import app

from support.cli import invoke
from support.recipes import shipped_recipes
from support.cli import runner

ROOT = Path(__file__).resolve().parents[2]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"gpupoor {__version__}"


def test_schema_is_json_with_every_section():
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.output)
    assert schema["additionalProperties"] is False and "training" in schema["properties"]


def test_validate_ok(make_recipe):
    result = runner.invoke(app, ["validate", str(make_recipe())])
    assert result.exit_code == 0 and ": ok (predicted peak " in result.output


def test_validate_reports_each_bad_recipe_and_exits_2(make_recipe, tmp_path):
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    good = make_recipe("good.yaml")
    bad = make_recipe("bad.yaml", data={"path": str(bad_data)})
    result = runner.invoke(app, ["validate", str(good), str(bad)])
    assert result.exit_code == 2
    assert f"{good}: ok" in result.output
    assert "bad.jsonl:2: missing field 'output'" in result.output


def test_validate_missing_model_directory(make_recipe, tmp_path):
    result = runner.invoke(app, ["validate", str(make_recipe(model={"name_or_path": "./no-such-model"}))])
    assert result.exit_code == 2 and "model.name_or_path" in result.output and "does not exist" in result.output


def test_validate_model_path_that_is_a_file(make_recipe, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = runner.invoke(app, ["validate", str(make_recipe(model={"name_or_path": "model.safetensors"}))])
    assert result.exit_code == 2, result.output
    assert (f"model.name_or_path: {tmp_path / 'model.safetensors'} is a file; expected a model directory "
            "(config.json and weights") in result.output and "does not exist" not in result.output


def test_cache_that_is_a_file_is_named_when_a_builtin_model_is_built(make_recipe, tmp_path, monkeypatch):
    (tmp_path / "cache-file").write_text("")
    monkeypatch.setenv("GPUPOOR_CACHE", str(tmp_path / "cache-file"))
    result = runner.invoke(app, ["validate", str(make_recipe(model={"name_or_path": "gpupoor:demo"}))])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'cache-file'} is a file, not a directory" in result.output
    assert "remove it, or set $GPUPOOR_CACHE" in result.output


def test_validate_model_dir_without_config(make_recipe, tmp_path):
    (tmp_path / "empty-model").mkdir()
    result = runner.invoke(app, ["validate", str(make_recipe(model={"name_or_path": "empty-model"}))])
    assert result.exit_code == 2 and "no config.json" in result.output


def test_validate_offline_hub_id_is_a_warning_not_an_error(make_recipe):
    result = runner.invoke(app, ["validate", str(make_recipe(model={"name_or_path": "Qwen/Qwen2.5-1.5B"}))])
    assert result.exit_code == 0 and "warning: model.name_or_path" in result.output


def test_every_shipped_recipe_passes_validate(tiny_model):
    for path in shipped_recipes():  # the real model's: tests/real/test_real_recipes.py
        result = runner.invoke(app, ["validate", str(path)])  # as shipped: the demo's model is built on first use
        assert result.exit_code == 0, result.output


def test_every_command_has_dash_h_and_no_flag_shows_a_value_type():
    """`-h` works like `--help`, and a flag reads as a flag (`--smoke`, not `--smoke <bool>`)."""
    import click
    from typer.main import get_command

    commands = get_command(app).commands
    assert {"train", "resume", "export", "merge-lora", "generate", "validate", "plan"} <= set(commands)
    for name in [None, *commands]:
        result = runner.invoke(app, [name, "-h"] if name else ["-h"], terminal_width=200)
        assert result.exit_code == 0, (name, result.output)
        assert "Usage:" in result.output
        assert "<bool>" not in result.output, name
        if name:
            flags = [opt for param in commands[name].params if isinstance(param, click.Option) and param.is_flag
                     for opt in param.opts]
            assert all(flag in result.output for flag in flags), name


def test_train_and_resume_take_the_launch_options_declared_once():
    """gpupoor.verb.LAUNCH_OPTIONS is added to both commands (launch_options), so their help and parsing agree."""
    from gpupoor.verb import LAUNCH_OPTIONS

    for command in ("train", "resume"):
        output = invoke(command, "--help").output
        for name in LAUNCH_OPTIONS:
            assert f"--{name.replace('_', '-')}" in output, (command, name)
    result = invoke("resume", "no-such-run", "--nnodes", "2")  # parsed, then refused without --nproc-per-node
    assert result.exit_code == 2 and "--nnodes without --nproc-per-node" in result.output


def test_every_verb_takes_debug_once_and_none_shows_what_the_decorator_gives_it():
    """gpupoor.verb.verb adds --debug to each verb (declared nowhere else) and hands train and resume their start
    time and stop requests, which are no options."""
    import typer.main

    commands = typer.main.get_command(app).commands
    assert len(commands) >= 15
    for name, command in commands.items():
        options = [option for parameter in command.params for option in parameter.opts]
        if name != "schema":  # prints the schema: nothing to fail
            assert options.count("--debug") == 1, (name, options)
        assert not {"--started", "--stop"} & set(options), (name, options)


def test_a_verbs_debug_shows_the_traceback_it_otherwise_keeps_back(tmp_path):
    missing = tmp_path / "missing"
    plain = invoke("status", missing)
    assert plain.exit_code == 2 and "error:" in plain.output and "Traceback" not in plain.output
    debugged = invoke("status", missing, "--debug")
    assert debugged.exit_code != 0 and isinstance(debugged.exception, Exception)
    assert type(debugged.exception).__name__ == "UserError"


def test_progress_lines_say_done_elapsed_and_time_left_at_most_every_few_seconds():
    from gpupoor.units import ProgressLine

    now, said = [0.0], []
    progress = ProgressLine(4, said.append, "merging", "tensors", every_s=10, clock=lambda: now[0])
    for step in (3.0, 12.0, 13.0, 40.0):
        now[0] = step
        progress.tick()
    assert said == ["merging: 2/4 tensors, 12s, about 12s left", "merging: 4/4 tensors, 40s"]
