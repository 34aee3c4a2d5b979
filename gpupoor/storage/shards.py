"""Which safetensors files hold a model directory's weights: the shards its index
(model.safetensors.index.json, transformers' `weight_map`) names, else the one model.safetensors. The one reader
of that index: checkpoint verification, merge-lora and the loading of a full fine-tune's weights ask here. And
its one writer besides transformers: `ShardWriter`, which merge-lora streams a merged model through."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpupoor.errors import UserError

MODEL_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def indexed_shards(directory: Path) -> list[str] | None:
    """The shard files `directory`'s index names (sorted, each once), or None when it has no index. ValueError
    when the index cannot be read, is not of transformers' form, or names a file outside the directory (a
    stored index must not point the reader at other files)."""
    index = directory / MODEL_INDEX
    if not index.is_file():
        return None
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index} is not a readable shard index ({type(exc).__name__}: {exc})") from None
    for name in names:
        if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{index} names {name!r}, not a file inside {directory}")
    return sorted(names)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (its index's shards, else model.safetensors), each there; a
    UserError saying what is missing otherwise. gpupoor reads no other weight format (a .bin is a pickle)."""
    try:
        shards = indexed_shards(directory)
    except ValueError as exc:
        raise UserError(str(exc), hint="write the model again with save_pretrained") from None
    if shards is None:
        if (directory / SINGLE_FILE).is_file():
            return [directory / SINGLE_FILE]
        raise UserError(f"{directory} has no safetensors weights (model.safetensors or an index of shards)",
                        hint="gpupoor reads only safetensors (no pickle); convert the base with save_pretrained")
    missing = [name for name in shards if not (directory / name).is_file()]
    if missing:
        raise UserError(f"{directory / MODEL_INDEX} names {missing[0]}, which {directory} does not have"
                        + (f" (nor {len(missing) - 1} more of the shards it names)" if len(missing) > 1 else ""),
                        hint="copy the model directory whole, or download it again")
    return [directory / name for name in shards]


class ShardWriter:
    """Collects tensors into safetensors shards of at most `max_bytes`, writing each as soon as it is full."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.current: dict = {}  # name -> tensor
        self.current_bytes = 0
        self.shards: list[list[str]] = []  # the names in each shard written
        self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_bytes:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self.shards)
        save_file(self.current, self.out_dir / f"part-{index:05d}.safetensors", metadata={"format": "pt"})
        self.shards.append(list(self.current))
        self.current, self.current_bytes = {}, 0

    def close(self) -> None:
        if self.current:
            self._flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self.out_dir / "part-00000.safetensors", self.out_dir / SINGLE_FILE)
            return
        weight_map = {}
        for index, names in enumerate(self.shards):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.out_dir / f"part-{index:05d}.safetensors", self.out_dir / final)
            weight_map.update({name: final for name in names})
        (self.out_dir / MODEL_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2))
