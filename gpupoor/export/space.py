"""The disk an export needs, checked before any work, and what a killed export left behind.

An adapter is merged into an fp32 model directory first (4 bytes a parameter: ~32 GB for an 8B model, however
small the files asked for) in the work directory (`--work-dir`, default the output folder); each file then takes
about parameters x its bits per weight / 8 in the output folder. Export refuses up front when a file system holds
less than that, and a disk that fills anyway is said with the same numbers. The temporary names carry the writer's
process id and host (`PID@HOST`), so the next export into a folder removes what an export that was killed on this
machine (SIGKILL, the OOM killer, a power cut) could not; another host's are named and left alone."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError
from gpupoor.storage.files import WRITER, sweep_leftovers
from gpupoor.units import format_bytes, format_bytes_apart

VERB = "export"  # its merge's scratch folder: gpupoor.model.merge.merge_scratch(VERB, ...), removed at the end
# What an export writes under a temporary name beside its files: each file before its rename.
LEFTOVER_FILES = re.compile(rf"\..+\.(?:gguf|Modelfile|quality\.json)\.tmp-{WRITER}")
# Scratch folders of gpupoor versions that did not put the writer in the name: said, never removed.
UNNAMED_SCRATCH = re.compile(r"\.gpupoor-export-(?!\d+@).+")


@dataclass
class SpacePlan:
    """About how many bytes the export writes where: the fp32 merge in `work_dir`, the files in `folder`."""

    work_dir: Path
    folder: Path
    merge_bytes: int  # the fp32 merged model
    file_bytes: int
    base_copy_bytes: int = 0  # a GGUF base dequantized beside the merge while it runs (removed before the files)

    def demands(self) -> list[tuple[Path, int]]:
        """(a folder, the bytes it must have free) per file system: one entry when both are on the same one."""
        if self.merge_bytes and _device(self.work_dir) != _device(self.folder):
            return [(self.work_dir, self.merge_bytes + self.base_copy_bytes), (self.folder, self.file_bytes)]
        return [(self.folder, self.needed())]

    def needed(self) -> int:
        """The most the export holds at once on one file system: the merge with the base's copy beside it, then
        the merge with the files (the copy is gone by then)."""
        return self.merge_bytes + max(self.base_copy_bytes, self.file_bytes)

    def breakdown(self) -> str:
        files = f"{format_bytes(self.file_bytes)} for the files in {self.folder}"
        if not self.merge_bytes:
            return files
        copy = f" (and {format_bytes(self.base_copy_bytes)} for the GGUF base's dequantized copy while it runs)" \
            if self.base_copy_bytes else ""
        return f"{format_bytes(self.merge_bytes)} for the fp32 merge in {self.work_dir}{copy} and {files}"

    def check(self) -> None:
        """Refuse before any work when a file system has less free space than the export writes there."""
        for where, needed in self.demands():
            free = _free(where)
            if free < needed:
                needs, has = format_bytes_apart(needed, free)  # rounded alike, they would read as if it fit
                raise UserError(f"not enough free space: the export writes about {needs} on the file system of "
                                f"{where} ({self.breakdown()}), and {has} is free there",
                                hint=self._hint())

    def disk_full(self, where: Path | None, finished: list[Path]) -> UserError:
        """The full disk said with the numbers, once what was half written is gone."""
        place = where or self.folder
        kept = f"; complete and kept: {', '.join(map(str, finished))}" if finished else ""
        needs, has = format_bytes_apart(self.needed(), _free(place))
        return UserError(f"the disk filled while writing {place}: the export needs about {needs} "
                         f"({self.breakdown()}), and {has} is free there now; what was half written was "
                         f"removed{kept}", hint=self._hint())

    def _hint(self) -> str:
        merge = "put the fp32 merge on another disk with --work-dir DIR, or " if self.merge_bytes else ""
        return f"free space there, or {merge}write the files elsewhere with --output, and export again"


def plan_space(config: dict, quants: list[str], file_bytes: Callable[[int, int, str], int], merges: bool,
               base_copy_bytes_per_parameter: int, work_dir: Path, folder: Path) -> SpacePlan | None:
    """The bytes this export writes where (None when the config's shape is not one gpupoor can count).
    `file_bytes(parameters, head_parameters, quant)`: the format's size of one file (ExportWriter.file_bytes).
    `base_copy_bytes_per_parameter`: a GGUF base is dequantized into the work directory before the merge too."""
    from gpupoor.model.shape import shape_from_config

    try:
        shape = shape_from_config(config, str(folder))
    except UserError:
        return None
    merge_bytes = 4 * shape.total_params if merges else 0
    base_copy_bytes = base_copy_bytes_per_parameter * shape.total_params if merges else 0
    files = sum(file_bytes(shape.total_params, shape.embedding_params, quant) for quant in quants)
    return SpacePlan(work_dir, folder, merge_bytes, files, base_copy_bytes)


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a folder the export will create is on that one's disk)."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("/"))


def _device(path: Path) -> int:
    return os.stat(_existing(path)).st_dev


def _free(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def sweep_export_leftovers(folders: list[Path], say: Callable[[str], None]) -> None:
    """Remove what exports that were killed left in these folders (their process is gone): the merge's scratch
    folder and files not yet renamed; name what could be such a leftover but is not ours to remove."""
    from gpupoor.model.merge import sweep_merge_scratch

    for folder in dict.fromkeys(folders):
        for removed, kept in (sweep_merge_scratch(folder, VERB), sweep_leftovers(folder, LEFTOVER_FILES)):
            for entry, size in removed:
                say(f"removed {entry} ({format_bytes(size)}), left by an export that was killed")
            for entry, why in kept:
                say(f"note: {entry} looks like an export's temporary file, left alone: {why}")
        for entry in _matching(folder, UNNAMED_SCRATCH):
            say(f"note: {entry} looks like the scratch folder of an export that was "
                "killed: delete it if no export is running")


def _matching(folder: Path, pattern: re.Pattern) -> list[Path]:
    return [entry for entry in folder.iterdir() if pattern.fullmatch(entry.name)] if folder.is_dir() else []
