"""One process's share of the terms when several train: DDP's gradient buckets, or FSDP's shards of the weights,
gradients and optimizer state with its all-gather working set (and what cpu_offload keeps in CPU memory)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpupoor.method_table import METHODS
from gpupoor.plan.result import Term
from gpupoor.plan.settings import Settings, what_trains
from gpupoor.model.shape import Shape
from gpupoor.plan.terms import DTYPE_BYTES, optimizer_bytes, trainable_params, weight_bytes
from gpupoor.plan.training import LayerTraining, Training
from gpupoor.units import format_bytes


@dataclass(frozen=True)
class ShardUnit:
    """The parameters of one fully_shard unit that FSDP shards: stored (frozen ones in the run's dtype, trainable
    ones in fp32) and as an all-gather materializes them (gpupoor.train.distributed's MixedPrecisionPolicy gathers
    every parameter in the compute dtype: bf16/fp16 under half precision, LoRA's fp32 adapters included)."""

    frozen: int  # bytes stored
    trainable: int  # bytes stored (fp32)
    gathered: int  # bytes of the whole unit once gathered
    trainable_params: int


def _adapter_params(shape: Shape, s: Settings, training: Training, layer: LayerTraining) -> int:
    """Parameters of the adapters in one decoder layer, counted as resolve_training counts them."""
    method = METHODS[training.method]
    return sum(method.adapter_params(s.rank, *shape.linear(n), n in training.feedforward) for n in layer.adapters)


def shard_units(shape: Shape, s: Settings) -> tuple[list[ShardUnit], ShardUnit]:
    """The units training wraps with fully_shard: each decoder layer, then the root (the embeddings, the final
    norm and the head: what no layer holds). FSDP shards every trainable parameter; the frozen ones unless
    distributed.shard_frozen is false, and never bitsandbytes' packed linear weights (whole on every process)."""
    training = what_trains(shape, s)
    dtype, shard_frozen = DTYPE_BYTES[s.precision], s.distribution.shard_frozen
    full = not METHODS[training.method].adapter
    units = []
    for layer in training.layers:
        # `full` trains these tensors in place; the other methods train peft's copies beside the frozen originals
        own = sum(map(shape.linear_params, layer.weights)) + shape.hidden * len(layer.norms)
        frozen = shape.layer_linear_params + shape.layer_other_params - (own if full else 0)
        if s.bits is not None:
            frozen -= shape.layer_linear_params
        units.append(_unit(frozen if shard_frozen else 0, own + _adapter_params(shape, s, training, layer), dtype))
    root_trainable = training.params - sum(unit.trainable_params for unit in units)  # what no layer trains
    root_frozen = shape.embedding_params * (1 if shape.tied else 2) + shape.hidden - (root_trainable if full else 0)
    return units, _unit(root_frozen if shard_frozen else 0, root_trainable, dtype)


def _unit(frozen_params: int, trainable_params: int, dtype: int) -> ShardUnit:
    return ShardUnit(frozen_params * dtype, trainable_params * 4, (frozen_params + trainable_params) * dtype,
                     trainable_params)


def fsdp_shares(shape: Shape, s: Settings) -> dict[str, tuple[int, int, str]]:
    """What one of N FSDP processes holds of the sharded terms: {term: (bytes every process keeps whole, bytes
    of its 1/N shard, detail)}. Gradients are reduce-scattered after every micro-batch's backward, so only
    their shard outlives it (no unsharded gradients accumulate)."""
    n = s.distribution.processes
    units, root = shard_units(shape, s)
    sharded = sum(unit.frozen for unit in units) + root.frozen
    # FSDP copies what it shards, so no sharded weight stays memory-mapped from the file (the CPU's unread rows).
    unmapped = replace(s, max_gpu_weights=None, resident_embedding_rows=None if sharded else s.resident_embedding_rows,
                       weights_mapped=s.weights_mapped and not sharded)
    whole = weight_bytes(shape, unmapped)[0] - sharded
    kept = "bitsandbytes' quantized linears" if s.bits else "frozen weights (distributed.shard_frozen: false)"
    weights = [f"1/{n} of {format_bytes(sharded)} frozen weights in {s.precision}"] if sharded else []
    weights += [f"{format_bytes(whole)} of {kept}, whole on every process"] if whole else []
    params = trainable_params(shape, s)
    optimizer, what = optimizer_bytes(params, s)
    master = " (master weights)" if not METHODS[s.method].adapter else ""
    return {"base_weights": (whole, -(-sharded // n), " + ".join(weights) or "none frozen: every weight trains"),
            "trainable": (0, -(-params * 4 // n),
                          f"1/{n} of {params / 1e6:,.2f}M trainable parameters in fp32{master}"),
            "gradients": (0, -(-params * 4 // n), f"fp32, 1/{n} of them: reduce-scattered after each micro-batch"),
            "optimizer": (0, -(-optimizer // n), f"{s.optimizer}: {what}, 1/{n} of them")}


def all_gather_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    """The all-gather working set of one FSDP process: whole units' parameters alive beside the shards.

    The root unit is gathered through the forward and the backward: the embedding runs first and the head
    last, the head's gradient comes first in the backward and the embedding's last (FSDP2 also leaves the root
    gathered after the forward for that reason). With reshard_after_forward a layer is freed after its forward
    and gathered again for its backward while FSDP2 prefetches the layer before it: two layers at a time.
    Without it every layer stays gathered from its forward to its backward, so at the start of the backward
    all of them are: the whole unsharded size, on top of the shards. A layer's backward also holds its
    trainable parameters' gradients unsharded (in the gathered dtype) and the reduce-scatter's fp32 copy of
    them (reduce_dtype fp32)."""
    units, root = shard_units(shape, s)
    if s.distribution.reshard_after_forward:
        layers = 2 * max((unit.gathered for unit in units), default=0)
        how = "2 layers (the one in backward, the one prefetched)"
    else:
        layers = sum(unit.gathered for unit in units)
        how = f"all {len(units)} layers (reshard_after_forward: false)"
    grads = (DTYPE_BYTES[s.precision] + 4) * max((unit.trainable_params for unit in units), default=0)
    return (root.gathered + layers + grads,
            f"gathered whole: root (embeddings, head, norm) {format_bytes(root.gathered)} + {how} "
            f"{format_bytes(layers)}; a layer's unsharded gradients and their reduce-scatter copy "
            f"{format_bytes(grads)}")


def distribute(shape: Shape, s: Settings, terms: list[Term]) -> list[Term]:
    """One process's terms on its device when several train. ddp: the whole model as one process holds it, plus
    DDP's gradient buckets. fsdp: a 1/N shard of the weights, gradients and optimizer state (with cpu_offload
    only what stays whole: the shards are in CPU memory, `offloaded_terms`), plus the all-gather working set.
    Activations and the loss come from each process's own micro-batch: unchanged."""
    strategy, offload = s.distribution.strategy, s.distribution.cpu_offload
    shares = fsdp_shares(shape, s) if strategy == "fsdp" else {}
    out = []
    for term in terms:
        if term.key in shares:
            whole, shard, detail = shares[term.key]
            term = Term(term.key, whole if offload else whole + shard,
                        detail + ("; the shard is in CPU memory (cpu_offload)" if offload and shard else ""))
        out.append(term)
        if term.key == "gradients" and strategy == "ddp":
            params = trainable_params(shape, s)  # trainable parameters are fp32: so are DDP's buckets
            out.append(Term("ddp_buckets", params * 4, "DDP's gradient buckets: each fp32 gradient copied once "
                            "more for the all-reduce"))
        if term.key == "optimizer" and strategy == "fsdp":
            out.append(Term("all_gather", *all_gather_bytes(shape, s)))
    return out


def offloaded_terms(shape: Shape, s: Settings) -> list[Term]:
    """What distributed.cpu_offload keeps in CPU memory instead of the GPU: each sharded term's 1/N."""
    if s.distribution.strategy != "fsdp" or not s.distribution.cpu_offload:
        return []
    return [Term(key, shard, detail) for key, (_, shard, detail) in fsdp_shares(shape, s).items() if shard]


def distribution_notes(s: Settings) -> list[str]:
    dist = s.distribution
    if dist.strategy == "single":
        return []
    notes = []
    if dist.strategy == "fsdp":
        notes.append(f"fully_shard on each decoder layer, then the root (kept gathered); every parameter gathered "
                     f"in {s.precision}, gradients reduce-scattered in fp32 (MixedPrecisionPolicy)")
        if s.teacher is not None:
            notes.append("the distillation teacher whole on every process (not sharded)")
        if s.reference == "copy":
            notes.append("DPO's reference copy whole on every process (not sharded)")
    if s.device == "cuda":
        notes.append("NCCL's communication buffers (allocated outside torch's allocator) on top: not counted")
    return notes
