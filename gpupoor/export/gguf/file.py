"""One GGUF file from a transformers model directory (config.json, safetensors, tokenizer), written with the gguf
package (llama.cpp's own Python library): no llama.cpp checkout, no compiler, no network.

The tensors stream: their names, shapes and types are declared first (the header holds them), then each is read
from its safetensors shard, put in llama.cpp's layout, quantized and written before the next is read, so memory
stays at about one tensor. The file is written under a temporary name beside the output and renamed into place
when complete: a failed or interrupted export (a full disk) leaves nothing under the final name."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpupoor import faults
from gpupoor.errors import UserError
from gpupoor.export.gguf.architectures import (Family, check_rope, extra_tensors, family_of, to_llama_cpp_layout,
                                          write_hyperparameters)
from gpupoor.export.gguf.tokenizer import write_tokenizer
from gpupoor.export.gguf.tensor_types import encode, nbytes, tensor_type
from gpupoor.export.gguf.quant_names import Quant
from gpupoor.export.writer import Written
from gpupoor.storage.files import ran_out_of_space, writer_tag
from gpupoor.storage.shards import weight_files


@dataclass
class Planned:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    shard: Path | None = None  # the safetensors file holding it (None: computed, not read: rope_freqs)


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def plan_tensors(model_dir: Path, config: dict, family: Family, quant: Quant) -> list[Planned]:
    """Every tensor the file will hold, with its GGUF name and type, read from the shards' headers only."""
    import gguf
    from safetensors import safe_open

    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_arch_enum(family.gguf_arch)], layers)
    tied = ties_embeddings(model_dir)
    planned = []
    for shard in weight_files(model_dir):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                if tied and name == "lm_head.weight":
                    continue  # llama.cpp uses token_embd as the head when there is no output tensor
                gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise UserError(f"{shard}: tensor {name} has no GGUF name for a {family.gguf_arch} model",
                                    hint="the checkpoint has weights llama.cpp's architecture does not; convert it "
                                    "with llama.cpp's convert_hf_to_gguf.py")
                shape = tuple(handle.get_slice(name).get_shape())
                is_head = gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight")
                planned.append(Planned(name, gguf_name, shape, tensor_type(quant, gguf_name, shape, layers, is_head),
                                       shard))
    for name, values in extra_tensors(config).items():  # 1-D: F32 whatever the quant
        planned.append(Planned(name, name, values.shape, tensor_type(quant, name, values.shape, layers, False)))
    return planned


def ties_embeddings(model_dir: Path) -> bool:
    """Whether the head is the embedding table (config.json may leave it to the class default, as Gemma's does)."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model_dir), "tie_word_embeddings", False))


def _arch_enum(gguf_arch: str) -> str:
    import gguf

    return next(key.name for key, value in gguf.MODEL_ARCH_NAMES.items() if value == gguf_arch)


def write_gguf(model_dir: Path, output: Path, quant: Quant, name: str) -> Written:
    """Write `model_dir` as one GGUF file at `output` (which must not exist) with `quant`'s tensor types."""
    import gguf
    from safetensors import safe_open

    config = read_config(model_dir)
    family = family_of(config, str(model_dir))
    check_rope(config, str(model_dir))
    planned = plan_tensors(model_dir, config, family, quant)
    extras = extra_tensors(config)
    temporary = output.with_name(f".{output.name}.tmp-{writer_tag()}")  # sweepable: space.py
    # gguf logs each special token it sets, and transformers' tokenizer warns about the pair template: not news.
    with _removed_unless_complete(temporary, output), _quiet("gguf"), _quiet("transformers"), \
            contextlib.closing(gguf.GGUFWriter(str(temporary), family.gguf_arch)) as writer:
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType[quant.file_type])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_hyperparameters(writer, config, family)
        write_tokenizer(writer, model_dir, config["vocab_size"])
        for tensor in planned:
            writer.add_tensor_info(tensor.gguf_name, tensor.shape, np.dtype(np.float32),
                                   nbytes(tensor.qtype, tensor.shape), raw_dtype=tensor.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in planned:  # the order the header declared them in
            if tensor.shard is None:
                writer.write_tensor_data(encode(extras[tensor.hf_name], tensor.qtype))
                continue
            with safe_open(tensor.shard, framework="pt") as handle:
                weights = handle.get_tensor(tensor.hf_name).float().numpy()
            if not np.isfinite(weights).all():
                raise UserError(f"{model_dir}: tensor {tensor.hf_name} holds NaN or infinite values: the model "
                                "diverged, and no quantization can represent it",
                                hint="export an earlier checkpoint (--checkpoint step-N) from before the loss diverged")
            weights = to_llama_cpp_layout(tensor.hf_name, weights, config, family)
            writer.write_tensor_data(encode(weights, tensor.qtype))
            faults.at_stage("gguf-tensor", quant.name)  # tests: a signal, a kill, a full disk mid-file
        writer.close()  # before the fsync and rename (closing again on the way out is a no-op)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, output)
    parameters = sum(int(np.prod(t.shape)) for t in planned)
    return Written(output, quant.name, output.stat().st_size, sum(nbytes(t.qtype, t.shape) for t in planned),
                   parameters, Counter(t.qtype.name for t in planned))


@contextlib.contextmanager
def _quiet(logger_name: str):
    import logging

    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _removed_unless_complete(temporary: Path, output: Path):
    """The temporary file removed on any failure or interruption. A full disk, however the library writing said
    it (numpy's short write has no errno), comes out as one OSError(ENOSPC) naming `output`: the caller knows
    how much space the export needs and says so."""
    try:
        yield
    except BaseException as exc:
        temporary.unlink(missing_ok=True)
        if ran_out_of_space(exc):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(output)) from exc
        raise
