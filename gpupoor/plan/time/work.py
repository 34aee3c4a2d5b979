"""The work one optimizer step does, term by term, from the model's config, the recipe and the data as the loop
collates it (gpupoor.plan.data_facts): the FLOPs of each kind of matmul, and the elementwise and optimizer work
counted in values touched. gpupoor.plan.time.estimate turns them into seconds. Torch is not imported.

A matmul of an (m x k) input by a (k x n) weight is 2mkn FLOPs forward, as much again for the input's gradient
and again for the weight's. A frozen weight has no weight gradient; layers below the lowest trained one run no
backward at all; checkpointing runs each layer's forward once more in backward. Attention is 2 matmuls of
head_dim per query-key pair, forward: the pairs of each example when it is attended alone (causal: half the
square), of each whole row under one masked call. The output head runs on target tokens only under the fused
loss. LoRA's matmuls are small and slow for their FLOPs: their own term."""

from __future__ import annotations

from dataclasses import dataclass

from gpupoor.method_table import METHODS
from gpupoor.plan.settings import Settings, what_trains
from gpupoor.model.shape import LINEARS, Shape


@dataclass(frozen=True)
class BatchFacts:
    """One micro-batch of the run's data, averaged over an epoch as the loop collates it."""

    micro_batches: int  # per epoch, as the loop counts them
    tokens: float  # positions the model computes, padding included
    real_tokens: float  # positions holding data
    targets: float  # positions the loss trains on
    example_pairs: float  # sum over examples of length^2 (attention per example)
    row_pairs: float  # sum over rows of width^2 (one masked call per row)


@dataclass(frozen=True)
class Work:
    """One term of a step's work: `amount` FLOPs (kind matmul, attention, lora) or values (elementwise,
    dequantize, optimizer)."""

    key: str
    kind: str
    amount: float
    detail: str


KINDS = ("matmul", "recompute", "attention", "lora", "elementwise", "casts", "dora", "dequantize", "optimizer", "calls",
         "decode", "decode_calls", "decode_steps", "decode_casts")  # the last four: GRPO's sampling (plan.time.grpo_work)


def step_work(shape: Shape, s: Settings, batch: BatchFacts, accumulation: int) -> list[Work]:
    """The work of one optimizer step: `accumulation` micro-batches like `batch`, then the optimizer."""
    training = what_trains(shape, s)
    layers = shape.layers
    active = layers - training.first_active_layer  # layers that run a backward
    recompute = active if s.checkpointing else 0
    passes = f"{layers} forward, {active} backward" + (f", {recompute} recomputed" if recompute else "")
    t, y = batch.tokens * accumulation, batch.targets * accumulation
    linear = shape.layer_linear_params
    weight_grads = sum(shape.linear_params(name) for layer in training.layers for name in layer.weights)
    # The lowest layer that runs a backward gets an input that needs no gradient: q, k and v skip theirs.
    first_inputs = (sum(shape.linear_params(name) for name in ("q_proj", "k_proj", "v_proj"))
                    if active and not training.embedding else 0)
    work = [Work("linears", "matmul", 2 * linear * t * (layers + active) + 2 * weight_grads * t
                 - 2 * first_inputs * t,
                 f"{linear / 1e6:.1f}M weights a layer x {t:,.0f} tokens: {passes}"
                 + (f"; weight gradients of {weight_grads / 1e6:.1f}M trained weights" if weight_grads else ""))]
    if recompute:  # its own kind: torch's recomputation stops once backward has what it needs
        work.append(Work("recompute", "recompute", 2 * linear * t * recompute,
                         f"checkpointing: {recompute} layers' linears forward again in backward"))
    per_example = s.attention_per_example
    pairs = (batch.example_pairs / 2 if per_example else batch.row_pairs) * accumulation
    work.append(Work("attention", "attention", 4 * shape.q * pairs * (layers + 2 * active + recompute),
                     f"{pairs:,.0f} query-key pairs a layer ("
                     + ("each example causal, alone" if per_example else "whole rows, one masked call") + ")"))
    head_tokens = y if s.fused_loss else t
    head_passes = 2 + (1 if training.head else 0)
    work.append(Work("head", "matmul", 2 * shape.embedding_params * head_tokens * head_passes,
                     f"{shape.vocab:,} x {shape.hidden} on {head_tokens:,.0f} "
                     + ("target tokens (fused loss)" if s.fused_loss else "tokens")))
    adapters = adapter_weights(shape, s, training)
    if adapters:
        lora = 2 * adapters * t * 3 + 2 * adapters * t * (1 if recompute else 0)
        if first_inputs:  # nor do the lowest layer's q, k and v adapters' A matrices (rank-wide, input-wide)
            first = training.layers[training.first_active_layer]
            lora -= 2 * t * s.rank * sum(shape.linear(name)[0] for name in ("q_proj", "k_proj", "v_proj")
                                         if name in first.adapters)
        detail = f"rank {s.rank}: {adapters / 1e6:.2f}M adapter weights x {t:,.0f} tokens"
        work.append(Work("lora", "lora", lora, detail))
        if METHODS[training.method].magnitude:
            forwards = (2 if recompute else 1) * accumulation
            work += dora_work(shape, s, training, t, forwards, passes=forwards / accumulation + 1)
    # Norms, rotary embeddings, the activation, residual adds: values touched per token and layer.
    per_token = 6 * shape.hidden + 3 * shape.intermediate + shape.q + 2 * shape.kv
    work.append(Work("elementwise", "elementwise", per_token * t * (layers + 2 * active + recompute),
                     f"norms, rotary, activation and residuals: {per_token:,} values a token and layer"))
    if s.half:  # each norm computes in fp32: the hidden state cast there and back
        casts = 2 * 2 * shape.hidden * t * (layers + 2 * active + recompute)
        work.append(Work("casts", "casts", casts, "half precision: each norm's input cast to fp32 and back"))
    if s.bits is not None:
        dequantized = linear * accumulation * (layers + active + recompute)
        work.append(Work("dequantize", "dequantize", dequantized,
                         f"{s.bits}-bit weights expanded for each matmul pass"))
    work += _extra_forwards(shape, s, batch, accumulation)
    work.append(Work("optimizer", "optimizer", training.params, f"{s.optimizer} on {training.params:,} parameters"))
    # Each module call costs the same dispatch overhead whatever its size: it is most of a tiny model's step.
    per_layer = module_calls_per_layer(training)
    calls = per_layer * (layers + active + recompute) * accumulation
    work.append(Work("calls", "calls", calls, f"{per_layer} module calls a layer and pass"))
    return work


# Module calls of a decoder layer besides its linears and their adapters' two each: the norms, rotary, the
# activation, the residual adds (and in a decode step the cache's update).
OTHER_CALLS_PER_LAYER = 6


def module_calls_per_layer(training) -> int:
    return len(LINEARS) + 2 * max((len(layer.adapters) for layer in training.layers), default=0) \
        + OTHER_CALLS_PER_LAYER


def adapter_weights(shape: Shape, s: Settings, training) -> int:
    """LoRA's (or DoRA's) weights over the trained layers: 0 for a method without low-rank adapters."""
    if not METHODS[training.method].low_rank:
        return 0
    return sum(s.rank * sum(shape.linear(name)) for layer in training.layers for name in layer.adapters)


def dora_work(shape: Shape, s: Settings, training, tokens: float, forwards: float, passes: float,
              dropped_out: bool = True) -> list[Work]:
    """peft's DoRA (peft/tuners/lora/dora.py), in each of `forwards` forward calls: W + BA rebuilt through an
    identity matrix and its row norms taken, detached (no backward); the output rescaled by magnitude / norm,
    elementwise over every adapted output of `tokens` tokens `passes` times (forward, recomputed, backward). With
    dropout (`dropped_out`: training mode), the base linear once more on the dropped-out input (forward, and its
    input's gradient)."""
    adapted = [shape.linear(name) for layer in training.layers for name in layer.adapters]
    rebuild = sum(2 * a * a * s.rank + 2 * a * s.rank * b for a, b in adapted) * forwards
    weights = sum(a * b for a, b in adapted)
    outputs = sum(b for _, b in adapted)
    work = [Work("dora_norms", "lora", rebuild, "DoRA: W + BA rebuilt for its norms, each forward"),
            Work("dora_weights", "dora", 3 * weights * forwards, f"DoRA: {weights / 1e6:.1f}M weights summed "
                 "and normed, each forward"),
            Work("dora_scale", "dora", 5 * outputs * tokens * passes,
                 f"DoRA: {outputs:,} adapted outputs a token rescaled" + (", forward and backward" if passes > 1
                                                                          else ""))]
    if s.dropout and dropped_out:
        base = sum(2 * a * b for a, b in adapted) * tokens * passes
        work.append(Work("dora_base", "matmul", base, "DoRA with dropout: the base linears again on the input"))
    return work


def _extra_forwards(shape: Shape, s: Settings, batch: BatchFacts, accumulation: int) -> list[Work]:
    """A distillation teacher's forward, or DPO's reference forward, on the same tokens (no backward)."""
    t, y = batch.tokens * accumulation, batch.targets * accumulation
    if s.teacher is not None:
        teacher = s.teacher
        flops = 2 * teacher.layer_linear_params * teacher.layers * t + 2 * teacher.embedding_params * y
        return [Work("teacher", "matmul", flops, f"the teacher's forward ({teacher.layers} layers x "
                     f"{teacher.hidden}) and head on {y:,.0f} target tokens"),
                Work("distill_loss", "elementwise", 4 * teacher.vocab * y, "KL over the vocabulary per target")]
    if s.reference != "none":
        flops = 2 * shape.layer_linear_params * shape.layers * t + 2 * shape.embedding_params * y
        return [Work("reference", "matmul", flops, f"DPO's reference forward ({s.reference})")]
    return []


def total_flops(work: list[Work]) -> float:
    return sum(w.amount for w in work if w.kind in ("matmul", "recompute", "attention", "lora", "decode"))


def model_flops_per_token(shape: Shape, s: Settings, seq: float) -> float:
    """The usual MFU numerator per trained token: 6 x weights for full fine-tuning, 4 x weights (no weight
    gradients) plus LoRA's 6 x adapters for a frozen base, the head on every token and causal attention of a
    `seq`-token example (forward + backward: 3 x 2 matmuls of head_dim per pair) included; recomputation not."""
    training = what_trains(shape, s)
    weights = shape.layer_linear_params * shape.layers + shape.embedding_params
    factor = 6 if not METHODS[training.method].adapter else 4
    adapters = adapter_weights(shape, s, training)
    attention = 3 * 4 * shape.q * shape.layers * seq / 2
    return factor * weights + 6 * adapters + attention


