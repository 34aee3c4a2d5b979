"""The integration tier of test_cli.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from gpupoor.cli import app

from support.cli import runner


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
    assert result.exit_code == 0, result.output
    assert "device cpu (no CUDA GPU found)" in result.output
    assert "attention sdpa (flash-attn not installed" in result.output
    assert "trainable" in result.output and "%" in result.output
