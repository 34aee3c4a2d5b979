"""`gpupoor eval`'s input checked before any model loads (issue #56): a wrong --pass-if, --data or --output is
exit 2 naming the option, what is allowed and what to do, never a failure after minutes of evaluation; and the
printed table stays readable (long answers cut, the --tasks columns apart)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl
from gpupoor.errors import UserError

LOADED = "the model was loaded"


@pytest.fixture
def no_loading(monkeypatch):
    """Loading the model says LOADED (exit 2): a check that passes it came too late."""
    import gpupoor.model.generation

    def refuse(*args, **kwargs):
        raise UserError(LOADED)

    monkeypatch.setattr(gpupoor.model.generation, "load_generator", refuse)


@pytest.fixture
def model(tmp_path) -> Path:
    """A directory that reads as an adapter (so a gain may be asked for); it is never loaded."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    return folder


@pytest.fixture
def rows(tmp_path) -> Path:
    return write_jsonl(tmp_path / "held-out.jsonl", alpaca_rows(2))


def eval_says(*args) -> tuple[int, str]:
    result = invoke("eval", *args)
    return result.exit_code, result.output


@pytest.mark.parametrize("spec, name, gain, least", [
    ("exact>=0.8", "exact", False, 0.8),
    (" exact-gain >= -0.25 ", "exact", True, -0.25),
    ("general>=2", "general", False, 2.0),
    (r"regex:^\d+$>=0.5", r"regex:^\d+$", False, 0.5),
    ("regex:a>=b>=1", "regex:a>=b", False, 1.0),  # split at the last comparison
    ("regex:x=>=.5", "regex:x=", False, 0.5),
    ("length<=20-gain>=0", "length<=20", True, 0.0),
    ("my_checks:valid>=1e-1", "my_checks:valid", False, 0.1),
])
def test_pass_if_splits_at_its_last_comparison(spec, name, gain, least):
    from gpupoor.commands.eval import parse_requirement

    requirement = parse_requirement(spec)
    assert (requirement.name, requirement.gain, requirement.least) == (name, gain, least)


@pytest.mark.parametrize("spec, said", [
    ("exact>=1.2.3", "'1.2.3' is not a finite number"),
    ("exact>=nan", "'nan' is not a finite number"),
    ("exact>=inf", "'inf' is not a finite number"),
    ("exact>=", "'' is not a finite number"),
    ("exact>=-0.1", "X is its mean, from 0 to 1 (a metric scores each answer from 0 to 1), not -0.1"),
    ("exact>=1.5", "from 0 to 1 (a metric scores each answer from 0 to 1), not 1.5"),
    ("exact-gain>=2", "X is its rise over the base, from -1 to 1"),
    ("general>=3", "--general asks 2 questions"),
    ("general>=1.5", "N a whole number from 0 to 2"),
    ("general-gain>=1", "write general>=N"),
    ("exact<=0.5", "the comparison is '<='; --pass-if takes >= only"),
    ("exact>0.5", "the comparison is '>'"),
    ("exact=>0.5", "the comparison is '=>'"),
    ("exact", "write METRIC>=X"),
    (">=0.5", "write METRIC>=X"),
])
def test_pass_if_refuses_what_cannot_be_judged(spec, said):
    from gpupoor.commands.eval import parse_requirement

    with pytest.raises(UserError) as info:
        parse_requirement(spec)
    assert said in str(info.value) and repr(spec) in str(info.value)


@pytest.mark.parametrize("extra, said", [
    (["--pass-if", "exact>=1.2.3"], "'1.2.3' is not a finite number"),
    (["--pass-if", "general>=3", "--general"], "--general asks 2 questions"),
    (["--pass-if", "contains>=0.5"], "'contains>=0.5': contains is not among the metrics scored (exact)"),
    (["--pass-if", r"regex:^\d+$>=0.5"], r"add --metric 'regex:^\d+$'"),
    (["--pass-if", "exact<=0.5"], "--pass-if takes >= only"),
])
def test_a_bad_pass_if_is_refused_before_the_model_loads(no_loading, model, rows, extra, said):
    code, output = eval_says(model, "--data", rows, *extra)
    assert code == 2 and said in output and LOADED not in output, output


def test_a_regex_metric_can_be_a_pass_if(no_loading, model, rows):
    code, output = eval_says(model, "--data", rows, "--metric", r"regex:^\d+$", "--pass-if", r"regex:^\d+$>=0.5")
    assert code == 2 and LOADED in output, output  # every check passed: the model is next


def test_a_gain_on_a_whole_model_is_refused_before_it_loads(no_loading, tmp_path, rows):
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "config.json").write_text("{}")
    code, output = eval_says(whole, "--data", rows, "--pass-if", "exact-gain>=0.5")
    assert code == 2 and "a gain needs the base column" in output and LOADED not in output, output


@pytest.mark.parametrize("option, value", [("--limit", "0"), ("--limit", "-3"), ("--max-new-tokens", "0")])
def test_counts_below_one_are_refused(no_loading, model, rows, option, value):
    code, output = eval_says(model, "--data", rows, option, value)
    assert code == 2 and option in output and LOADED not in output, output


# --output ------------------------------------------------------------------------------------------------


def test_output_that_is_a_directory_is_refused_before_the_model_loads(no_loading, model, rows, tmp_path):
    code, output = eval_says(model, "--data", rows, "--output", tmp_path)
    assert code == 2 and f"--output {tmp_path} is a directory" in output and "name a file" in output
    assert LOADED not in output


def test_output_that_is_a_device_is_refused(no_loading, model, rows):
    code, output = eval_says(model, "--data", rows, "--output", os.devnull)
    assert code == 2 and f"--output {os.devnull} is not a regular file" in output and LOADED not in output, output


def test_output_in_a_missing_folder_is_refused(no_loading, model, rows, tmp_path):
    target = tmp_path / "no-such-folder" / "e.json"
    code, output = eval_says(model, "--data", rows, "--output", target)
    assert code == 2 and "does not exist" in output and "mkdir -p" in output and LOADED not in output, output
    assert not target.parent.exists()


def test_output_under_a_file_is_refused(no_loading, model, rows, tmp_path):
    code, output = eval_says(model, "--data", rows, "--output", rows / "e.json")
    assert code == 2 and f"{rows} is a file, not a directory" in output and LOADED not in output, output


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc: a folder no user can write")
def test_output_in_a_folder_nobody_can_write_is_refused(no_loading, model, rows):
    code, output = eval_says(model, "--data", rows, "--output", "/proc/gpupoor-eval.json")
    assert code == 2 and "--output /proc/gpupoor-eval.json: cannot write in /proc" in output, output
    assert LOADED not in output


def test_output_that_is_an_input_is_refused(no_loading, model, rows, tmp_path):
    """The report would overwrite the user's held-out rows, or the model's own files."""
    before = rows.read_bytes()
    code, output = eval_says(model, "--data", rows, "--output", rows)
    assert code == 2 and "is the --data file" in output and LOADED not in output, output
    assert rows.read_bytes() == before
    code, output = eval_says(model, "--data", rows, "--output", model / "adapter_config.json")
    assert code == 2 and "is a file of the model" in output and LOADED not in output, output


# --data --------------------------------------------------------------------------------------------------


def test_a_missing_data_file_speaks_of_data_not_of_a_recipe(no_loading, model, tmp_path):
    code, output = eval_says(model, "--data", tmp_path / "nope.jsonl")
    assert code == 2 and f"--data {tmp_path / 'nope.jsonl'}: no such file" in output, output
    assert "recipe" not in output and "current directory" in output and LOADED not in output


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc/self/fd, where /dev/stdin leads")
def test_a_pipe_is_named_as_typed(no_loading, model, tmp_path):
    """/dev/stdin is a link to /proc/self/fd/0, a pipe under a shell's `|`: said as the user wrote it."""
    read_end, write_end = os.pipe()
    try:
        stdin = tmp_path / "stdin"
        stdin.symlink_to(f"/proc/self/fd/{read_end}")
        code, output = eval_says(model, "--data", stdin)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert code == 2 and f"--data {stdin}: not a regular file" in output and "pipe:[" not in output, output
    assert "save the rows to a .jsonl file" in output and LOADED not in output


def test_a_malformed_row_is_refused_before_the_model_loads_named_as_typed(no_loading, model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("bad.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": \n')
    code, output = eval_says(model, "--data", "bad.jsonl")
    assert code == 2 and "bad.jsonl:2: not valid JSON" in output and str(tmp_path) not in output, output
    assert LOADED not in output
    Path("rows.txt").write_text("{}\n")
    code, output = eval_says(model, "--data", "rows.txt")
    assert code == 2 and "--data rows.txt: not a data file eval reads" in output and ".jsonl" in output, output


# What is printed ----------------------------------------------------------------------------------------


def test_long_answers_are_cut_in_the_table_only():
    from gpupoor.commands.eval import Column, HeldOut, clip, render
    from gpupoor.scorers import parse_scorer

    rambling = "la " * 2000
    rows = [HeldOut("rows.jsonl:1", {}, [], "x" * 500, ())]
    columns = [Column("base", [rambling], {"exact": [0.0]}, 1.0), Column("tuned", ["short"], {"exact": [0.0]}, 0.5)]
    table = render({}, columns, [parse_scorer("exact")], rows, general=False)
    assert "(6000 characters)" in table and "(500 characters)" in table and "'short'" in table
    assert max(len(line) for line in table.splitlines()) < 3 * 250
    assert clip("a" * 200) == repr("a" * 200) and clip("a" * 201) == repr("a" * 200) + "... (201 characters)"


def test_the_tasks_table_keeps_its_figures_apart():
    from gpupoor.commands.eval_tasks import render_tasks

    columns = {"base": {"a_long_task_name_of_someones": {"perplexity": 123456789.123, "word_perplexity": 98765.4321}},
               "tuned": {"a_long_task_name_of_someones": {"perplexity": 2345678.5, "word_perplexity": 12.5}}}
    lines = render_tasks(columns).splitlines()
    assert lines[0].split() == ["task", "/", "metric", "base", "tuned"]
    for line, metric in zip(lines[1:], ("perplexity", "word_perplexity")):
        label, base, tuned = line.rsplit(None, 2)
        assert label == f"a_long_task_name_of_someones / {metric}"
        assert float(base) == pytest.approx(columns["base"]["a_long_task_name_of_someones"][metric], rel=1e-3)
        assert float(tuned) == pytest.approx(columns["tuned"]["a_long_task_name_of_someones"][metric], rel=1e-3)
    assert len({len(line) for line in lines}) == 1  # aligned
