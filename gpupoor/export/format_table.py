"""The export formats `gpupoor export --format` takes: one `ExportWriter` each (gpupoor/export/writer.py). A new
format is a class behind that interface and its entry here; the CLI's `--format` and `--quant` help and the
command's checks read this table."""

from __future__ import annotations

from gpupoor.errors import UserError
from gpupoor.export.gguf.format import GGUFExport
from gpupoor.export.writer import ExportWriter

EXPORT_FORMATS: dict[str, ExportWriter] = {writer.name: writer for writer in (GGUFExport(),)}
DEFAULT_FORMAT = "gguf"


def export_format(name: str) -> ExportWriter:
    """The writer for `--format NAME`, or a UserError saying which formats there are."""
    if name not in EXPORT_FORMATS:
        raise UserError(f"--format {name!r}: gpupoor exports {', '.join(EXPORT_FORMATS)}",
                        hint="merged safetensors: gpupoor merge-lora")
    return EXPORT_FORMATS[name]


def format_help() -> str:
    return "; ".join(f"{w.name} ({w.summary})" for w in EXPORT_FORMATS.values()) + "."


def quant_help() -> str:
    """Each format's quantizations, the default first named."""
    kinds = [f"{' | '.join(w.quants)} (default {w.default_quant})" + (f" for {w.name}" if len(EXPORT_FORMATS) > 1
                                                                      else "") for w in EXPORT_FORMATS.values()]
    return "; ".join(kinds) + "; repeat for one file each, from one merge."
