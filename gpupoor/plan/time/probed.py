"""A step and a start-up on this machine from what gpupoor.run.step_probe measured (torch is not imported): the
recipe trained at two depths of its own model, extrapolated to all its layers, and the real weights' load from
its measured parts. Issue #57: the plan measures the machine it runs on rather than transfer efficiencies fitted
on another one (gpupoor.plan.time.estimate's COEFFICIENTS stay as the fallback where nothing could be measured).

Step times vary from batch to batch with the batch's padded width: each timed batch (the same at both depths:
the difference between the depths is the layers alone) is extrapolated on its own, a layer's share per padded
token, and the medians taken at the epoch's mean padded tokens."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# How far a measured plan may be off either way, from the held-out runs (docs/benchmarks.md, "Time plan accuracy"):
# a step's time, and the start-up's (its parts are timed one by one, and a first start reads files cold).
STEP_SPREAD = 0.15
STARTUP_SPREAD = 0.25
# Start-up parts the probe's runs measure at the real tokenizer and data (the model part is the real weights').
MEASURED_PARTS = ("accelerator and tokenizer", "data", "optimizer")
# transformers' GGUF loader: the file's metadata read three times (gpupoor's check, the config, the weights) and
# a tensor-name map built for each module, about 1.46 modules a tensor in a llama-like decoder (13 and 9 a layer)
GGUF_READS = 3
MODULES_PER_TENSOR = 1.46


@dataclass(frozen=True)
class ProbedStep:
    """A step of the whole model extrapolated from the probe's two depths."""

    step_s: float  # one optimizer step (its micro-batches and the optimizer)
    first_step_extra_s: float  # the first step's warm-up beyond a step
    build_s: float  # the model built at the shallow depth: the load's fixed part beyond reading the weights
    startup_parts: dict  # measured parts of training's start-up at the real tokenizer and data
    layer_s: float  # one layer's share of a micro-batch
    rest_s: float  # the rest of a micro-batch (embedding, head and loss, fixed costs)
    depths: tuple[int, int]
    probe_s: float  # how long the probe took
    save_s: float | None = None  # a checkpoint of the whole model (its trained weights and optimizer state)


def _extrapolate(low: tuple[int, float], high: tuple[int, float], layers: int) -> tuple[float, float]:
    """(the whole model's value, one layer's) from values at two depths."""
    (d1, v1), (d2, v2) = low, high
    per_layer = (v2 - v1) / max(d2 - d1, 1)
    return v1 + (layers - d1) * per_layer, per_layer


def probed_step(probe: dict, *, accumulation: int, optimizer_s: float, epoch_tokens: float | None,
                first_tokens: list[float] | None, quantized: bool = False) -> ProbedStep:
    """`probe`: gpupoor.run.step_probe.probe_steps' answer. `optimizer_s`: the optimizer's share of a step (from
    the work model: the probe trains one micro-batch a step, so accumulation repeats the rest). `epoch_tokens`,
    `first_tokens`: the padded tokens of an epoch's mean micro-batch and of the probe's own first batches (None
    for GRPO, whose rows are sampled). `quantized`: a 4- or 8-bit base, quantized layer by layer as it loads.

    Each timed batch is extrapolated on its own (the same batch at both depths), per padded token where the
    tokens are known, and the median taken: a burst of another process's work slows a step or two, not the
    median, and the batches' widths differ (the epoch's first ones may be narrower than its mean)."""
    layers, cycle = probe["layers"], probe.get("cycle", 1)
    (low, high) = probe["depths"][0], probe["depths"][-1]
    depths = (low["layers"], high["layers"])
    timed = [_cycle_means(d["step_s"][1:], cycle) for d in (low, high)]
    count = min(len(timed[0]), len(timed[1]))
    tokens = first_tokens[1:1 + count] if epoch_tokens and first_tokens and cycle == 1 else None
    if tokens is not None and (len(tokens) < count or min(tokens) <= 0):
        tokens = None
    rests, per_token = [], []
    for i in range(count):
        whole, per_layer = _extrapolate((depths[0], timed[0][i]), (depths[1], timed[1][i]), layers)
        rests.append(whole - layers * per_layer)
        per_token.append(per_layer / tokens[i] if tokens is not None else per_layer)
    # the layers' work grows with the batch's tokens, the rest (the head on the targets, fixed costs) hardly
    per_layer = statistics.median(per_token) * (epoch_tokens if tokens is not None else 1.0)
    whole = statistics.median(rests) + layers * per_layer
    micro = max(whole - optimizer_s, whole * 0.5)  # the optimizer's share, at most half of the probe's step
    step = accumulation * micro + (whole - micro)
    firsts = [(d["layers"], d["step_s"][0] - statistics.median(d["step_s"][1:])) for d in (low, high)]
    first, _ = _extrapolate(firsts[0], firsts[1], layers)
    parts = low["startup"]
    save = None
    if low.get("save_s") is not None and high.get("save_s") is not None:  # the run's last checkpoint, at each depth
        save, _ = _extrapolate((depths[0], low["save_s"]), (depths[1], high["save_s"]), layers)
    builds = [(d["layers"], d["startup"].get("model", 0.0)) for d in (low, high)]
    build = low["startup"].get("model", 0.0)
    if quantized:  # bitsandbytes quantizes every layer as the real load does: that part grows with the depth
        build = max(build, _extrapolate(builds[0], builds[1], layers)[0])
    return ProbedStep(step_s=step, first_step_extra_s=max(first, 0.0),
                      # the shallow model built: its embedding, head and method; random weights at every depth cost far
                      # more than the real load's (transformers builds those on no device and reads them), so
                      # that part is measured as the weights' read instead (weights_read_s)
                      build_s=build, save_s=max(save, 0.0) if save is not None else None,
                      startup_parts={p: parts[p] for p in MEASURED_PARTS if p in parts},
                      layer_s=per_layer, rest_s=statistics.median(rests), depths=depths,
                      probe_s=probe.get("probe_s", 0.0))


def _cycle_means(times: list[float], cycle: int) -> list[float]:
    """GRPO samples once every `cycle` steps: the means of whole cycles (a step alone is an update or a sampling)."""
    return [statistics.fmean(times[i:i + cycle]) for i in range(0, len(times) - cycle + 1, cycle)]


def weights_read_s(load: dict | None, weight_bytes: int) -> float | None:
    """Seconds reading the real weights takes here, from gpupoor.run.step_probe's measured parts: a GGUF's
    metadata reads, name maps and dequantization, or a weight file's bytes at the measured read rate."""
    if not load:
        return None
    if "reader_s" in load:
        modules = MODULES_PER_TENSOR * load["tensors"]
        return (GGUF_READS * load["reader_s"] + modules * load["name_map_s"]
                + load["tensor_bytes"] * load["dequantize_s_per_byte"])
    if load.get("read_rate"):
        return weight_bytes / load["read_rate"]
    return None


def spread(value: float, share: float) -> tuple[float, float]:
    return value * (1 - share), value * (1 + share)
