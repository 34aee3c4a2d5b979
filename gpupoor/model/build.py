"""The model to train: the base (gpupoor.model.load) with the recipe's method applied (gpupoor.model.methods),
activation checkpointing set up and every trainable tensor in fp32; and a summary of what trains."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from gpupoor.model.load import load_base_model, probing
from gpupoor.model.methods import apply_method, check_module_names
from gpupoor.recipe.schema import MemorySection, ModelSection, PeftSection, QuantizationSection


@dataclass
class ModelSummary:
    total_params: int
    trainable_params: int
    weight_bytes: int

    @property
    def trainable_percent(self) -> float:
        return 100.0 * self.trainable_params / max(self.total_params, 1)


def build_model(location: str, model_cfg: ModelSection, peft_cfg: PeftSection, *, quant: QuantizationSection,
                memory: MemorySection, precision: str, attention: str, device: str, seed: int, smoke: bool = False,
                resuming: bool = False):
    """The model to train on `device`: the base with the recipe's method applied (peft adapters on a frozen
    base, or the base's own chosen weights for `full`). With memory.max_gpu_memory on a GPU, accelerate's device
    map keeps what does not fit in CPU memory. `resuming`: a checkpoint's weights replace the adapter's at once,
    so peft.init_adapter is not read (it may be gone by now)."""
    if resuming and peft_cfg.init_adapter is not None:
        peft_cfg = peft_cfg.model_copy(update={"init_adapter": None})
    model = load_base_model(location, model_cfg, quant=quant, precision=precision, attention=attention, device=device,
                            seed=seed, smoke=smoke, max_gpu_memory=memory.max_gpu_memory)
    if memory.gradient_checkpointing:
        # Non-reentrant: gives bitwise-equal gradients, and needs no input that requires grad. Offloading the
        # saved inputs to the host only means something when they live on a GPU.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              offload=memory.gradient_checkpointing == "offload" and device == "cuda")
        _no_input_grads(model)
    check_module_names(model, peft_cfg)
    torch.manual_seed(seed)  # LoRA A is randomly initialized: make it a function of the seed
    model = apply_method(model, peft_cfg, load_init_weights=not (smoke or probing()))
    _no_input_grads(model.get_base_model() if hasattr(model, "get_base_model") else model)
    # peft keeps LoRA weights in fp32 but leaves modules_to_save (and `full` its weights) in the base dtype: an fp16
    # copy cannot be unscaled by the GradScaler and a bf16 one loses small AdamW updates. Trainable tensors are fp32.
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    if hasattr(model, "peft_config"):
        # What a user loads the adapter onto: the hub id as named, or the local directory as an absolute path.
        model.peft_config["default"].base_model_name_or_path = location
        model.peft_config["default"].revision = model_cfg.revision
        if location.lower().endswith(".gguf"):
            # peft looks for config.json beside the base at each save (to tell a resized vocabulary) and warns that
            # a GGUF file has none; gpupoor never resizes it.
            warnings.filterwarnings("ignore", message=r"Could not find a config file in .*\.gguf")
    return model


def _no_input_grads(model) -> None:
    """transformers (enabling checkpointing) and peft (wrapping) each make the embedding output require grad, so
    gradients reach adapters through *reentrant* checkpoints. Non-reentrant ones need no such thing, and with it
    every frozen layer below the first trainable one would keep (or recompute) activations for a backward that
    needs none. Each registration replaces the handle the last one kept: remove each as it is made."""
    with contextlib.suppress(AttributeError):  # no hook registered
        model.disable_input_require_grads()


def summarize(model) -> ModelSummary:
    total = trainable = weight_bytes = 0
    for param in model.parameters():
        count = param.numel()
        # bitsandbytes packs two 4-bit values per uint8 element: count the logical parameters.
        if param.dtype == torch.uint8 and hasattr(param, "quant_state"):
            count *= 2
        total += count
        trainable += count if param.requires_grad else 0
        weight_bytes += param.numel() * param.element_size()
    return ModelSummary(total, trainable, weight_bytes)
