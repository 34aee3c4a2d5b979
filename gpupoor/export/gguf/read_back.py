"""A written GGUF read back by an independent reader, for its perplexity (gpupoor/export/quality.py) and the tests:
transformers' GGUF loader, which dequantizes with the gguf package, or for what that loader cannot read, the gguf
package's reader put into the model built from the original config."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_gguf_back(path: Path, model_dir: Path, dtype=torch.float32):
    """The model in a written GGUF file, in `dtype`: through transformers' GGUF loader, or for the one
    architecture it cannot load (Gemma 1), through the gguf package's reader and dequantizer into the model
    class built from the original config (`read_with_gguf`)."""
    import functools
    from unittest import mock

    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers import AutoModelForCausalLM

    from gpupoor.export.gguf.architectures import rope_scaling

    # The loader's own tqdm bar ignores transformers' progress-bar switch: one bar per file is noise here.
    with mock.patch.object(gguf_loading, "tqdm", functools.partial(gguf_loading.tqdm, disable=True)):
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("model_type") == "gemma":
            return read_with_gguf(path, model_dir).to(dtype)
        if rope_scaling(config)["rope_type"] != "default":
            # transformers' GGUF loader reads no rope-scaling keys (llama.cpp does): its config would rotate
            # differently from the file's, so the tensors are read from the file into the original config.
            from transformers import AutoConfig

            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                        config=AutoConfig.from_pretrained(model_dir))
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


def read_with_gguf(path: Path, model_dir: Path):
    """Every tensor of the file dequantized by the gguf package, put back in transformers' layout and loaded
    into the model built from `model_dir`'s config."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpupoor.export.gguf.architectures import family_of, from_llama_cpp_layout

    config = json.loads((model_dir / "config.json").read_text())
    family = family_of(config, str(model_dir))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == family.gguf_arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    hf_names = {names.get_name(name, try_suffixes=(".weight", ".bias")): name for name in model.state_dict()}
    state = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = hf_names[tensor.name]
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype("float32")
        state[name] = torch.from_numpy(from_llama_cpp_layout(name, values, config, family).copy())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise ValueError(f"{path}: tensors do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
