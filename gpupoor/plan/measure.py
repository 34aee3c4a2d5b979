"""What the time plan measures once and caches (gpupoor.plan.facts): the data as the loop collates it, and this
machine's matmul rate at the run's precision and shapes. It imports torch, so `gpupoor plan` runs it in a child
process (`python -m gpupoor.plan.measure REQUEST.json`): the plan itself never imports torch, and a repeated plan
reads the cache.

The data is built by training's own code (gpupoor.data.build.build_data: the same tokenized cache, mixture,
held-out rows and sampler), so a run started after the plan finds its tokens cached; each micro-batch of the first
epoch is collated as the loop collates it and counted."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

# Micro-batches collated to count an epoch: beyond this many, an even sample of them (the counts are averages).
MAX_COUNTED_BATCHES = 2000
PROBE_REPEATS = 10
PROBE_SECONDS = 0.05  # each probe matmul about this long: tens of milliseconds in all


def data_facts(recipe_json: dict, sampler: str) -> dict:
    """The first epoch's micro-batches counted: tokens (padding included), targets, attention pairs. The recipe
    as the plan loaded it (its paths already resolved)."""
    from gpupoor.data.build import build_data
    from gpupoor.model.load import load_tokenizer, model_location
    from gpupoor.recipe.schema import Recipe

    started = time.perf_counter()
    recipe = Recipe.model_validate(recipe_json)
    location = model_location(recipe.model, Path.cwd())
    tokenizer = load_tokenizer(location, recipe.model)
    data = build_data(recipe.data, tokenizer, micro_batch_size=recipe.training.micro_batch_size, seed=recipe.seed,
                      base_dir=Path.cwd(), sampler=sampler, resuming=False)
    batches = data.plan.epoch(0)
    step = max(1, len(batches) // MAX_COUNTED_BATCHES)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    counted = [_count(data.collate(indices, pad)) for indices in batches[::step]]
    mean = {key: statistics.fmean(c[key] for c in counted) for key in counted[0]}
    return {"micro_batches": len(data.plan), **mean, "data_s": round(time.perf_counter() - started, 3),
            "cache_hit": data.cache_hit}


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

    if threads:
        torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    F.linear(x, w)
    sync()
    times = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        F.linear(x, w)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / min(times)


def probe_rows(device: str, hidden: int, intermediate: int, tokens: int) -> int:
    """Rows of the probe matmul: the micro-batch's tokens, cut so that one call stays near PROBE_SECONDS at a
    rough 100 GFLOP/s (CPU) or 100 TFLOP/s (GPU)."""
    rate = 1e14 if device == "cuda" else 1e11
    return int(max(16, min(tokens, rate * PROBE_SECONDS / (2 * hidden * intermediate))))


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    started = time.perf_counter()
    import peft  # noqa: F401 -- what training imports: their time is start-up the plan predicts
    import torch
    import transformers  # noqa: F401

    answer: dict = {"import_s": round(time.perf_counter() - started, 3), "torch": torch.__version__}
    if "rate" in request:
        r = request["rate"]
        answer["rate"] = matmul_rate(r["device"], r["precision"], r.get("threads"), r["m"], r["k"], r["n"])
    if "data" in request:
        d = request["data"]
        answer["data"] = data_facts(d["recipe"], d["sampler"])
    if "write_to" in request:
        from gpupoor.plan.facts import write_rate

        answer["write_rate"] = write_rate(Path(request["write_to"]))
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
