"""What the time plan measures once and caches (gpupoor.plan.time.facts): the data as the loop collates it, and this
machine's matmul rate at the run's precision and shapes. It imports torch, so `gpupoor plan` runs it in a child
process (`python -m gpupoor.run.measuring REQUEST.json`): the plan itself never imports torch, and a repeated plan
reads the cache.

The data is built by training's own code (gpupoor.data.build.build_data: the same tokenized cache, mixture,
held-out rows and sampler), so a run started after the plan finds its tokens cached; each micro-batch of the first
epoch is collated as the loop collates it and counted."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

# Micro-batches collated to count an epoch: beyond this many, an even sample of them (the counts are averages).
MAX_COUNTED_BATCHES = 2000
PROBE_REPEATS = 10
PROBE_SECONDS = 0.05  # each probe matmul about this long: tens of milliseconds in all
FIRST_BATCHES = 16  # the epoch's first micro-batches counted one by one (the step probe trains on them)


def data_facts(recipe_json: dict, sampler: str) -> dict:
    """The first epoch's micro-batches counted: tokens (padding included), targets, attention pairs. The recipe
    as the plan loaded it (its paths already resolved)."""
    from gpupoor.data.build import build_data
    from gpupoor.model.gguf import is_gguf, read_gguf
    from gpupoor.model.load import load_tokenizer, model_location
    from gpupoor.recipe.schema import Recipe

    recipe = Recipe.model_validate(recipe_json)
    location = model_location(recipe.model, Path.cwd())
    if is_gguf(location):
        read_gguf(Path(location))  # as a train's memory plan has read it before the tokenizer loads
    started = time.perf_counter()
    tokenizer = load_tokenizer(location, recipe.model)
    tokenizer_s = time.perf_counter() - started  # a train's start-up loads it the same way
    data = build_data(recipe.data, tokenizer, micro_batch_size=recipe.training.micro_batch_size, seed=recipe.seed,
                      base_dir=Path.cwd(), sampler=sampler, resuming=False)
    batches = data.plan.epoch(0)
    step = max(1, len(batches) // MAX_COUNTED_BATCHES)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    counted = [_count(data.collate(indices, pad)) for indices in batches[::step]]
    mean = {key: statistics.fmean(c[key] for c in counted) for key in counted[0]}
    # the step probe trains the epoch's first batches: their padded tokens scale its times to the epoch's mean
    first = [_count(data.collate(indices, pad))["tokens"] for indices in batches[:FIRST_BATCHES]]
    return {"micro_batches": len(data.plan), **mean, "data_s": round(time.perf_counter() - started, 3),
            "cache_hit": data.cache_hit, "first_tokens": first, "tokenizer_s": round(tokenizer_s, 3)}


def _count(batch: dict) -> dict:
    """One collated micro-batch (plain, packed or preference pairs) counted."""
    import torch

    counts = dict.fromkeys(("tokens", "real_tokens", "targets", "example_pairs", "row_pairs"), 0)
    for key in [k for k in batch if k.endswith("input_ids")]:
        prefix = key[: -len("input_ids")]
        rows, width = batch[key].shape
        counts["tokens"] += rows * width
        counts["row_pairs"] += rows * width * width
        counts["targets"] += int((batch[prefix + "labels"] != -100).sum())
        mask = batch.get(prefix + "token_mask", batch.get(prefix + "attention_mask"))
        used_per_row = mask.sum(1).tolist() if mask is not None else [width] * rows
        positions = batch.get(prefix + "position_ids")
        for row, used in enumerate(used_per_row):
            counts["real_tokens"] += used
            if positions is None:
                counts["example_pairs"] += used * used
                continue
            # packed: an example starts where the positions restart at 0
            starts = (positions[row, :used] == 0).nonzero().flatten().tolist() + [used]
            lengths = torch.tensor(starts[1:]) - torch.tensor(starts[:-1])
            counts["example_pairs"] += int((lengths * lengths).sum())
    return counts


def matmul_rate(device: str, precision: str, threads: int | None, m: int, k: int, n: int) -> float:
    """FLOP/s of an (m x k) by (k x n) F.linear at the run's precision: the best of a few, after a warm-up."""
    import torch
    import torch.nn.functional as F

    dtype = _prepare(threads, precision)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    return 2 * m * k * n / _best_time(lambda: F.linear(x, w), device)


def lora_rate(device: str, precision: str, threads: int | None, m: int, k: int, n: int, rank: int) -> float:
    """FLOP/s of LoRA's own matmuls at the run's precision and shapes: an (m x k) input through A (k x rank), then
    B (rank x n). Thin matmuls run far below a square one's rate, and differently so per precision (a CPU's bf16
    matrix units gain little at rank 16)."""
    import torch
    import torch.nn.functional as F

    dtype = _prepare(threads, precision)
    x = torch.randn(m, k, device=device, dtype=dtype)
    a = torch.randn(rank, k, device=device, dtype=dtype)
    b = torch.randn(n, rank, device=device, dtype=dtype)
    return 2 * m * rank * (k + n) / _best_time(lambda: F.linear(F.linear(x, a), b), device)


def attention_rate(device: str, precision: str, threads: int | None, heads: int, kv_heads: int, head_dim: int,
                   length: int, count: int, per_example: bool) -> float:
    """FLOP/s, as gpupoor.plan.time.work counts them, of training's attention forward and backward: `count` examples of
    `length` tokens, each attended alone by training's own per-example function (the CPU's path for packed rows),
    or rows of that width under one causal call."""
    import torch
    import torch.nn.functional as F

    from gpupoor.model.packed_attention import PerExampleAttention

    dtype = _prepare(threads, precision)
    q, k, v = (torch.randn(count * length, h, head_dim, device=device, dtype=dtype, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(count * length, heads, head_dim, device=device, dtype=dtype)

    def once():
        if per_example:
            out = PerExampleAttention.apply(q, k, v, (length,) * count, head_dim ** -0.5)
        else:
            rows = [t.view(count, length, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=kv_heads != heads)
            out = out.transpose(1, 2).reshape(grad.shape)
        out.backward(grad)

    pairs = count * length * length / (2 if per_example else 1)
    return 3 * 4 * heads * head_dim * pairs / _best_time(once, device)


def values_rate(device: str, precision: str, threads: int | None, m: int, hidden: int, intermediate: int) -> float:
    """Values a second of a decoder layer's elementwise work at the run's dtype and batch: an RMSNorm, the gated
    activation, a residual add (their outputs counted)."""
    import torch
    import torch.nn.functional as F

    dtype = _prepare(threads, precision)
    x, gate, up = (torch.randn(m, n, device=device, dtype=dtype) for n in (hidden, intermediate, intermediate))

    def once():
        normed = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(dtype)
        return normed + x, F.silu(gate) * up

    return m * (2 * hidden + intermediate) / _best_time(once, device)


def optimizer_rate(threads: int | None, params: int = 2**21) -> float:
    """Parameters a second an AdamW step updates (torch's default multi-tensor path, fp32 master weights whatever the
    run's precision): a layer's worth of tensors, their gradients and moments."""
    import torch

    _prepare(threads)
    weights = [torch.zeros(params // 8, requires_grad=True) for _ in range(8)]
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer = torch.optim.AdamW(weights, lr=1e-4)
    return params / _best_time(optimizer.step, "cpu")


def call_seconds(threads: int | None, chain: int = 20) -> float:
    """Seconds of one tiny module call, forward and backward (a chain of small linears, one backward): the fixed
    cost each of a layer's modules pays whatever its size."""
    import torch
    import torch.nn.functional as F

    _prepare(threads)
    x = torch.randn(8, 64, requires_grad=True)
    weights = [torch.randn(64, 64, requires_grad=True) for _ in range(chain)]

    def once():
        y = x
        for w in weights:
            y = F.linear(y, w)
        y.sum().backward()

    return _best_time(once, "cpu") / chain


def _prepare(threads: int | None, precision: str = "fp32"):
    """The probe's thread count set, and its dtype (training's map of precisions)."""
    import torch

    from gpupoor.hardware import DTYPES

    if threads:
        torch.set_num_threads(threads)
    return DTYPES[precision]


def _best_time(once, device: str) -> float:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    once()
    sync()
    times = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_probe_shape(data: dict, per_example: bool) -> tuple[int, int]:
    """The probe's example length and count from the data facts: the length-weighted mean example (per example:
    sum of len^2 over sum of len) or the row width, and as many as one micro-batch holds."""
    if per_example:
        length = data["example_pairs"] / max(data["real_tokens"], 1)
        tokens = data["real_tokens"]
    else:
        length = data["row_pairs"] / max(data["tokens"], 1)
        tokens = data["tokens"]
    length = max(16, 16 * round(length / 16))
    return length, max(1, min(64, round(tokens / length)))


def probe_rows(device: str, hidden: int, intermediate: int, tokens: int) -> int:
    """Rows of the probe matmul: the micro-batch's tokens, cut so that one call stays near PROBE_SECONDS at a
    rough 100 GFLOP/s (CPU) or 100 TFLOP/s (GPU)."""
    rate = 1e14 if device == "cuda" else 1e11
    return int(max(16, min(tokens, rate * PROBE_SECONDS / (2 * hidden * intermediate))))
