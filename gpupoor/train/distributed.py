"""Several processes: what the launcher started, FSDP2 sharding, and the collective half of a checkpoint.

DDP comes from accelerate (`Accelerator.prepare`). FSDP2 is PyTorch's `fully_shard`, applied here to each
decoder layer and then to the root module: accelerate builds FSDP only on accelerators, and gpupoor's CPU
tests (and CPU users) need the same code path a GPU runs. Checkpoints under FSDP keep the layout every other
run writes (a PEFT adapter or a transformers model directory, gathered to the first process), with the
optimizer state saved sharded by `torch.distributed.checkpoint` (DCP): no process ever holds all of it, and
DCP reshards it when a run resumes on another number of processes.

Everything here that takes a model is collective under FSDP: every process must call it, in the same order.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

DCP_OPTIMIZER = "optimizer"  # the folder of a checkpoint holding DCP's optimizer shards (+ .metadata)
TORCH_OPTIMIZER = "optimizer.pt"
PARAM_GROUPS = "param_groups.json"  # beside the shards: each group's hyperparameters and parameter names


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model, *, precision: str, device: str, shard_frozen: bool, reshard_after_forward: bool,
                cpu_offload: bool):
    """Apply FSDP2 in place: each decoder layer is one unit (gathered for its forward and backward, then
    freed), the root holds the rest (embeddings, final norm, head). Returns the model (now an FSDPModule)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # bitsandbytes keeps quantized weights packed in integer storage with their quantization state beside
    # them: sharding along dim 0 would split the blocks from their scales. They stay whole on every process.
    ignored = {p for p in model.parameters() if not p.is_floating_point()}
    if not shard_frozen:
        ignored |= {p for p in model.parameters() if not p.requires_grad}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    # Weights are gathered in the compute dtype (LoRA's fp32 adapters included: FSDP gathers one dtype per
    # unit); gradients are reduced in fp32 so the average over processes loses nothing.
    mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload and device != "cpu" else OffloadPolicy()
    options = {"reshard_after_forward": reshard_after_forward, "mp_policy": mixed, "offload_policy": offload,
               "ignored_params": ignored or None}
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    # The root unit (embeddings, final norm, head) stays gathered from its forward to the end of backward, as
    # FSDP2 does by default: the fused loss multiplies by the head's weight after the model's forward returns.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    return model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks, by the class names transformers itself never splits across devices."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise RuntimeError(f"{type(base).__name__} does not name its decoder layers (_no_split_modules): "
                           "FSDP would gather the whole model at once; use distributed.strategy ddp")
    return layers


def gather_weights(model, whole_model: bool) -> dict:
    """The trained weights (`whole_model`: every weight) as full tensors on the CPU of the first process; the
    others get {}. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=not whole_model)
    return get_model_state_dict(model, options=options)


def load_weights(model, weights: dict, adapter: bool) -> list[str]:
    """Full tensors from a saved adapter (its PEFT keys) or model shard into the sharded model. Returns the
    keys that name no weight of the model. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    names = _adapter_names(model) if adapter else {name: name for name in model.state_dict()}
    unknown = [key for key in weights if key not in names]
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, {names[key]: value for key, value in weights.items() if key in names},
                         options=options)
    return unknown


def _adapter_names(model) -> dict[str, str]:
    """PEFT's saved key -> the model's parameter name, asking peft itself how it names what it saves (it drops
    the adapter name and renames some keys): the values of the trainable state dict identify each entry."""
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    live = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    by_identity = {id(value): name for name, value in live.items()}
    saved = get_peft_model_state_dict(model, state_dict=live)
    return {key: by_identity[id(value)] for key, value in saved.items() if id(value) in by_identity}


def save_optimizer(model, optimizer, directory: Path, main: bool, before_write=None) -> None:
    """DCP: each process writes its own shard of the optimizer's tensors; the first also writes DCP's .metadata
    and the hyperparameters of each parameter group as JSON. Collective; an error in DCP on any process raises
    on all, as that process's error (`dcp_error`). `before_write()`: called on each process just before it
    writes its shard (fault injection).
    Only tensors go through DCP: DCP would pickle anything else, and gpupoor unpickles nothing it reads back."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer.state:
        # No step yet (a checkpoint at step 0): get_optimizer_state_dict would create the state with a fake
        # step (AdamW's step count 1, zero moments), and a resumed run would not be the run that never stopped.
        # An empty DCP checkpoint and the groups' hyperparameters say "no state yet".
        _dcp_save({"state": {}}, directory, before_write)
        groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        state = {"param_groups": groups, "empty": True}
    else:
        state = get_optimizer_state_dict(model, optimizer)
        odd = [f"{name}.{key}" for name, values in state["state"].items() for key, value in values.items()
               if not torch.is_tensor(value)]
        if odd:
            raise RuntimeError(f"optimizer state that is not a tensor cannot be saved sharded: {odd[:3]}")
        _dcp_save({"state": state["state"]}, directory, before_write)
    if main:
        (directory / PARAM_GROUPS).write_text(json.dumps(state["param_groups"] if "empty" not in state else state,
                                                         indent=1))


def _dcp_save(state: dict, directory: Path, before_write) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, *args, **kwargs):
            if before_write is not None:
                before_write()
            return super().write_data(*args, **kwargs)

    try:
        dcp.save(state, storage_writer=Writer(str(directory)))
    except CheckpointException as exc:
        raise dcp_error(exc) from None


def dcp_error(exc: BaseException) -> Exception:
    """The error under DCP's CheckpointException, which every process raises when any failed: it derives from
    BaseException (no `except Exception` stops it) and its text is every process's traceback. An OSError (a full
    disk) comes first, as it was raised, with its errno and path."""
    failures = [failure[0] for failure in getattr(exc, "failures", {}).values()]  # (exception, traceback) by rank
    for error in sorted(failures, key=lambda error: not isinstance(error, OSError)):
        if isinstance(error, Exception):
            return error
    return RuntimeError(f"torch.distributed.checkpoint failed: {type(exc).__name__} on ranks "
                        f"{sorted(getattr(exc, 'failures', {}))}")


def load_optimizer(model, optimizer, checkpoint: Path) -> None:
    """The optimizer state of a checkpoint, whichever layout wrote it, into this run's: DCP shards (resharded
    to this number of processes) or a whole optimizer.pt (FSDP takes its full tensors and shards them)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    if (checkpoint / DCP_OPTIMIZER).is_dir():
        import torch.distributed.checkpoint as dcp

        saved = json.loads((checkpoint / DCP_OPTIMIZER / PARAM_GROUPS).read_text())
        if isinstance(saved, dict) and saved.get("empty"):  # saved before the first step: hyperparameters only
            for group, values in zip(optimizer.param_groups, saved["param_groups"]):
                group.update({key: tuple(value) if key == "betas" else value for key, value in values.items()})
            return
        state = get_optimizer_state_dict(model, optimizer)  # the layout (and this process's shards) to fill
        try:
            with warnings.catch_warnings():  # one process reading a sharded save is the intent (resume --force)
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
                dcp.load({"state": state["state"]}, storage_reader=_SafeReader(checkpoint / DCP_OPTIMIZER))
        except dcp.CheckpointException as exc:
            raise dcp_error(exc) from None
        state["param_groups"] = [{**group, **({"betas": tuple(group["betas"])} if "betas" in group else {})}
                                 for group in saved]
        set_optimizer_state_dict(model, optimizer, state)
        return
    saved = torch.load(checkpoint / TORCH_OPTIMIZER, map_location="cpu", weights_only=True)
    if not is_sharded(model) or not saved["state"]:
        # (An empty state through DCP's loader would be created with a fake step: load it as it is.)
        optimizer.load_state_dict(saved)
        return
    # optimizer.pt numbers the parameters in the order the optimizer was built with: the model's trainable
    # parameters in registration order, which sharding keeps. Name them for DCP's full-state loader.
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    # DCP's full-state loader takes only the hyperparameters this optimizer's groups already have: one that a
    # schedule added before the save (LambdaLR's initial_lr) fails in it (KeyError in torch 2.13). They are
    # set afterwards, as the DCP path sets its param_groups.json.
    by_name = {"state": {names[index]: value for index, value in saved["state"].items()},
               "param_groups": [{**{key: value for key, value in group.items() if key in live},
                                 "params": [names[i] for i in group["params"]]}
                                for group, live in zip(saved["param_groups"], optimizer.param_groups)]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    for group, values in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({key: value for key, value in values.items() if key != "params"})


def _safe_unpickler():
    import pickle

    class MetadataUnpickler(pickle.Unpickler):
        """DCP's .metadata is a pickle of its own dataclasses: load those and nothing else (no code runs)."""

        def find_class(self, module: str, name: str):
            # The module is checked before anything is imported; only then the object itself.
            allowed = module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                                 "torch") or (module, name) in _METADATA_GLOBALS
            value = super().find_class(module, name) if allowed else None
            if module.startswith("torch.distributed.checkpoint.") and isinstance(value, type) \
                    or (module, name) in _METADATA_GLOBALS or module == "torch" and isinstance(value, torch.dtype):
                return value
            raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}: not loaded")

    return MetadataUnpickler


_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("pathlib", "Path")}


def optimizer_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint's DCP optimizer state cannot be loaded, read before a resume chooses the checkpoint (so it
    is skipped like a corrupt one): its .metadata refused by the restricted unpickler or not DCP's metadata, or
    param_groups.json not parameter groups. None when it can be (or the checkpoint has an optimizer.pt)."""
    folder = checkpoint / DCP_OPTIMIZER
    if not folder.is_dir():
        return None
    try:
        _read_metadata(folder)
    except Exception as exc:  # a malformed pickle raises nearly anything: each one means "not loadable"
        return f"{DCP_OPTIMIZER}/.metadata is refused ({type(exc).__name__}: {exc})"
    try:
        groups = json.loads((folder / PARAM_GROUPS).read_text())
        groups = groups["param_groups"] if isinstance(groups, dict) else groups
        if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
            raise TypeError("not a list of parameter groups")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{DCP_OPTIMIZER}/{PARAM_GROUPS} cannot be read ({type(exc).__name__}: {exc})"
    return None


def _read_metadata(folder: Path):
    """DCP's .metadata through the restricted unpickler; anything but DCP's Metadata record is refused."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    with open(folder / ".metadata", "rb") as handle:
        metadata = _safe_unpickler()(handle).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _SafeReader(path: Path):  # noqa: N802 -- a reader object, built where torch is imported
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def local_values(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP's parameters and gradients), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective for sharded ones; a reduced norm is already whole), or the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (one all-reduce: a sync point every process must reach);
    with one process, `flag`. For decisions that must be common: one process that acts alone (stops, saves,
    skips a collective) leaves the others waiting in the next collective forever."""
    if not _several_processes():
        return bool(flag)
    import torch.distributed as dist

    agreed = torch.tensor([float(flag)], device=_collective_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return bool(agreed.item() > 0)


def summed(*values: float) -> list[float]:
    """Each value summed over the processes (one all-reduce in float64: a sync point); one process: the values."""
    if not _several_processes():
        return list(values)
    import torch.distributed as dist

    total = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.tolist()


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device() -> torch.device:
    """Where a collective's tensor must live: NCCL reduces CUDA tensors only (on this process's GPU, which
    accelerate selected), gloo reduces CPU ones."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else torch.device("cpu")
