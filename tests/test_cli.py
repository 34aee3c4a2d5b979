"""The CLI surface: validate, schema, --version, output modes, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from gpupoor import __version__
from gpupoor.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"gpupoor {__version__}"


def test_schema_is_json_with_every_section():
    result = runner.invoke(app, ["schema"])
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
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        result = runner.invoke(app, ["validate", str(path)])  # as shipped: the demo's model is built on first use
        assert result.exit_code == 0, result.output


def test_bad_recipe_is_exit_2_without_traceback(make_recipe, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(make_recipe().read_text() + "trainig:\n  max_steps: 3\n")
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 2
    assert "unknown key 'trainig'" in result.output and "did you mean 'training'" in result.output
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback(tmp_path):
    from gpupoor.errors import UserError

    missing = str(tmp_path / "missing.yaml")
    # Without --debug: a message and exit 2 (CliRunner records that exit as a SystemExit), no traceback.
    plain = runner.invoke(app, ["train", missing])
    assert plain.exit_code == 2 and type(plain.exception) is SystemExit and plain.exception.code == 2
    assert "recipe not found" in plain.output and "Traceback" not in plain.output
    # With --debug the UserError itself escapes, traceback and all, instead of being turned into exit 2.
    debug = runner.invoke(app, ["train", missing, "--debug"])
    assert isinstance(debug.exception, UserError) and "recipe not found" in str(debug.exception)
    assert debug.exc_info is not None and debug.exc_info[2] is not None


def test_plain_progress_lines_when_not_a_tty(make_recipe, tmp_path):
    result = runner.invoke(app, ["train", str(make_recipe(logging={"progress": "auto", "every_steps": 2})),
                                 "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert "tok/s" in lines[0] and "peak" in lines[0] and "eta" in lines[0]


def test_startup_summary_says_what_was_chosen_and_why(make_recipe, tmp_path):
    result = runner.invoke(app, ["train", str(make_recipe()), "--output-dir", str(tmp_path / "run")])
    assert "device cpu (no CUDA GPU found)" in result.output
    assert "attention sdpa (flash-attn not installed" in result.output
    assert "trainable" in result.output and "%" in result.output


def test_help_does_not_import_torch():
    code = "import sys; from gpupoor.cli import app; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_validate_runs_without_importing_torch(make_recipe):
    """What keeps validate well under 2 s per recipe: it never loads torch or transformers."""
    code = ("import sys\nfrom gpupoor.cli import app\ntry:\n    app(['validate', sys.argv[1]])\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(make_recipe())], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "0 []"
