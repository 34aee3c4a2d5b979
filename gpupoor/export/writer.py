"""The interface every export format implements (torchtune's `_CheckpointerInterface` is the model): what
`gpupoor export` asks of a format, so that the command knows no format by name. GGUF is the one implementation
(gpupoor/export/gguf/format.py); the table of formats, which the CLI's `--format` and `--quant` read, is
gpupoor/export/format_table.py.

The command refuses what it cannot do before any work (`check_installed`, `check_quants`, `check_model`), counts
the disk each file needs (`file_bytes`), merges an adapter once, then per quantization writes a file (`write`:
under a temporary name, renamed when complete), the files a runtime wants beside it (`companions`), and reads the
file back to score it (`perplexity`). Heavy libraries are imported inside the methods: the CLI builds its help
from the table without them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from gpupoor.errors import UserError


@dataclass
class Written:
    """One exported file."""

    path: Path
    quant: str
    size_bytes: int  # the whole file, metadata (tokenizer) included
    tensor_bytes: int
    parameters: int
    types: Counter = field(default_factory=Counter)  # tensor type name -> tensors of that type

    @property
    def bits_per_weight(self) -> float:
        """Of the tensors alone: a small model's tokenizer would otherwise count as weights."""
        return 8 * self.tensor_bytes / self.parameters


class ExportWriter(ABC):
    """One export format. Class attributes describe it for the CLI; methods do its work."""

    name: str  # --format NAME
    suffix: str  # the files' extension, with the dot
    summary: str  # what reads the files, for --format's help
    quants: Mapping[str, object]  # --quant NAME -> its specification, in the order the help lists them
    default_quant: str

    def check_quants(self, quants: list[str]) -> list[str]:
        """The names deduplicated in order (the default when none), or a UserError naming the unknown one."""
        unknown = [q for q in quants if q not in self.quants]
        if unknown:
            raise UserError(f"--quant {unknown[0]!r} is not a {self.name.upper()} type gpupoor writes",
                            hint="use one or more of " + ", ".join(self.quants))
        return list(dict.fromkeys(quants)) or [self.default_quant]

    @abstractmethod
    def check_installed(self) -> None:
        """A UserError when the library the format needs is missing or too old."""

    @abstractmethod
    def check_model(self, config: dict, where: str) -> None:
        """A UserError when the model (its config.json) is one this format cannot hold."""

    def notes(self, adapter_base: str | None, quants: list[str], config: dict) -> list[str]:
        """What to know before reading the quality table (`adapter_base`: the adapter's base, if one is merged;
        `config`: the model's config.json)."""
        return []

    @abstractmethod
    def file_bytes(self, parameters: int, head_parameters: int, quant: str) -> int:
        """About the size of one file: for the disk check before any work."""

    @abstractmethod
    def write(self, model_dir: Path, target: Path, quant: str, name: str) -> Written:
        """`model_dir` (a transformers model directory) as one file at `target`, which must not exist; nothing
        under that name unless complete."""

    def companions(self, model_dir: Path, file: Written, config: dict,
                   trained_format: str | None) -> dict[Path, str]:
        """Text files to write beside `file` (path -> text): what a runtime needs to serve it."""
        return {}

    @abstractmethod
    def perplexity(self, file: Path, text, model_dir: Path, dtype) -> float:
        """The file read back and scored on `text` (gpupoor.export.quality.EvalText), computing in `dtype`."""
