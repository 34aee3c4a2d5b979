"""`gpupoor export` refuses bad input before it writes anything (#56): an --eval text too short to score (found
only after the GGUF and its Modelfile were written, and both left), a --work-dir that is a file, an --output that is
a directory, the quality table's name taken by a folder; and a disk refusal that shows needed > free however close."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli import invoke

pytest.importorskip("gguf")


def refused(result, *parts: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "run again with --debug" not in result.output, result.output
    for part in parts:
        assert part in result.output, (part, result.output)


def test_an_eval_text_of_under_two_tokens_is_refused_before_any_file_is_written(tiny_model, tmp_path):
    (tmp_path / "short.txt").write_text("a")
    out = tmp_path / "out"
    result = invoke("export", tiny_model, "-q", "f32", "--output", out / "m.gguf", "--eval", tmp_path / "short.txt")
    refused(result, "--eval", "short.txt: fewer than two tokens of text to score")
    assert "wrote" not in result.output and not out.exists()


def test_a_work_dir_that_is_a_file_is_refused(tiny_model, tmp_path):
    (tmp_path / "work").write_text("mine")
    out = tmp_path / "out"
    result = invoke("export", tiny_model, "-q", "f32", "--output", out / "m.gguf", "--no-quality",
                    "--work-dir", tmp_path / "work")
    refused(result, f"--work-dir {tmp_path / 'work'}", "is a file, not a directory")
    assert (tmp_path / "work").read_text() == "mine" and not out.exists()


def test_a_work_dir_that_does_not_exist_is_refused_not_created(tiny_model, tmp_path):
    """It was created (parents and all) and the export ran: a mistyped --work-dir put tens of GB of merge on
    whichever disk the typo landed on."""
    out = tmp_path / "out"
    result = invoke("export", tiny_model, "-q", "f32", "--output", out / "m.gguf", "--no-quality",
                    "--work-dir", tmp_path / "scrach" / "work")
    refused(result, f"--work-dir {tmp_path / 'scrach' / 'work'}", "does not exist")
    assert not (tmp_path / "scrach").exists() and not out.exists()


def test_an_output_that_is_a_directory_is_refused(tiny_model, tmp_path):
    (tmp_path / "m.gguf").mkdir()
    refused(invoke("export", tiny_model, "-q", "f32", "--output", tmp_path / "m.gguf", "--no-quality"),
            "is a directory")


def test_a_quality_table_name_taken_by_a_folder_is_refused_before_any_work(tiny_model, tmp_path):
    (tmp_path / "m.quality.json").mkdir()
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    result = invoke("export", tiny_model, "-q", "f32", "--output", tmp_path / "m.gguf", "--eval",
                    tmp_path / "text.txt")
    refused(result, "m.quality.json (the quality table's file) is not a file")
    assert not (tmp_path / "m.gguf").exists()


def test_a_disk_short_by_a_little_reads_short(tmp_path, monkeypatch):
    """1.005 GiB needed and 1.002 GiB free were both "1.00 GiB": the refusal read as if the export fitted."""
    from gpupoor.errors import UserError
    from gpupoor.export import space
    from gpupoor.units import GiB, MiB

    plan = space.SpacePlan(tmp_path, tmp_path, merge_bytes=0, file_bytes=GiB + 5 * MiB)
    monkeypatch.setattr(space, "_free", lambda path: GiB + 2 * MiB)
    with pytest.raises(UserError) as refusal:
        plan.check()
    assert "writes about 1.005 GiB" in str(refusal.value) and "and 1.002 GiB is free" in str(refusal.value)
    full = str(plan.disk_full(tmp_path, []))
    assert "needs about 1.005 GiB" in full and "and 1.002 GiB is free there now" in full


@pytest.mark.parametrize("a,b,expected", [
    (2**30 + 5 * 2**20, 2**30 + 2 * 2**20, ("1.005 GiB", "1.002 GiB")),
    (2**30 + 3, 2**30, ("1.000000003 GiB", "1.000000000 GiB")),
    (500 * 2**20, int(499.8 * 2**20), ("500.0 MiB", "499.8 MiB")),
    (30 * 2**30, 2 * 2**30, ("30.00 GiB", "2.00 GiB")),  # apart already: format_bytes' rounding
])
def test_sizes_that_differ_read_differently(a, b, expected):
    from gpupoor.units import format_bytes_apart

    assert format_bytes_apart(a, b) == expected
