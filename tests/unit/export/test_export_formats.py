"""The export interface (gpupoor/export/writer.py): the command reads the format table, the CLI's help is built
from it, and a second format would be one class behind the interface."""

from __future__ import annotations

import re

import pytest

from support.cli import invoke


def test_every_quant_of_every_format_is_in_the_cli_help():
    from gpupoor.export.format_table import EXPORT_FORMATS

    help_text = re.sub(r"[\s│]+", " ", invoke("export", "--help").output)  # rich wraps and boxes the lines
    for writer in EXPORT_FORMATS.values():
        assert writer.name in help_text and writer.summary in help_text
        for quant in writer.quants:
            assert re.search(rf"\b{re.escape(quant)}\b", help_text), quant


def test_quant_names_are_checked_against_the_writers_table():
    from gpupoor.errors import UserError
    from gpupoor.export.format_table import export_format

    gguf = export_format("gguf")
    assert gguf.check_quants(["q4_0", "q8_0", "q4_0"]) == ["q4_0", "q8_0"]
    assert gguf.check_quants([]) == [gguf.default_quant]
    with pytest.raises(UserError, match="'q3_k_s'"):
        gguf.check_quants(["q4_0", "q3_k_s"])
    with pytest.raises(UserError, match="gpupoor exports gguf"):
        export_format("onnx")


def test_the_command_calls_only_the_interface(tiny_model, tmp_path, monkeypatch):
    """A format that writes plain text files goes through the whole command: the files, their companions and
    the quality rows come from its methods, so the command knows no format by name."""
    from gpupoor.commands.export import export
    from gpupoor.export import format_table as formats
    from gpupoor.export.writer import ExportWriter, Written

    class TextWriter(ExportWriter):
        name, suffix, summary, quants, default_quant = "text", ".txt", "tests", {"a": 1, "b": 2}, "a"
        calls: list = []

        def check_installed(self):
            self.calls.append("installed")

        def check_model(self, config, where):
            self.calls.append(("model", config["model_type"]))

        def file_bytes(self, parameters, head_parameters, quant):
            return parameters * self.quants[quant]

        def write(self, model_dir, target, quant, name):
            target.write_text(f"{name} {quant}")
            return Written(target, quant, target.stat().st_size, 10 * self.quants[quant], 10)

        def companions(self, model_dir, file, config, trained_format):
            return {file.path.with_suffix(".card"): f"card of {file.path.name}"}

        def perplexity(self, file, text, model_dir, dtype):
            raise AssertionError("--no-quality measures nothing")

    monkeypatch.setitem(formats.EXPORT_FORMATS, "text", TextWriter())
    said = []
    rows = export(tiny_model, quants=["b", "a"], fmt="text", output=tmp_path / "m.txt", quality=False,
                  say=said.append)
    assert [row.type for row in rows] == ["b", "a"] and [row.bits_per_weight for row in rows] == [16.0, 8.0]
    assert (tmp_path / "m-b.txt").read_text().endswith(" b") and (tmp_path / "m-a.card").read_text() == \
        "card of m-a.txt"
    assert TextWriter.calls == ["installed", ("model", "llama")]
    with pytest.raises(TypeError):  # keyword-only: 8 positional arguments were one swap from a wrong export
        export(tiny_model, ["a"])
