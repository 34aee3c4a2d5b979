"""The time plan: how long a run takes on this machine (or on a named GPU, on paper), and whether it finishes
inside a time limit. Torch is not imported: the measured facts (the data as the loop collates it, the rates of
this machine at the run's precision and shapes) come from gpupoor.plan.time.facts, which measures them once in a
child process and caches them per machine.

A step's time is its work (gpupoor.plan.time.work), each kind over the rate this machine measured for work like it
(Rates: matmuls at the run's shapes, LoRA's thin ones at its rank, training's own attention at its example
lengths, elementwise values, an AdamW step, a tiny module call), weighed by a coefficient fitted on measured
runs (COEFFICIENTS: the inverse of that kind's efficiency against its probe; bench/time_accuracy.py
--calibrate), plus a fixed cost per micro-batch and per step. The whole run adds start-up (imports, loading the
weights, the data), the first step's warm-up and each checkpoint save (its bytes at the disk's write rate)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from gpupoor.decisions import count_steps
from gpupoor.plan.time.work import BatchFacts, Work, step_work, total_flops
from gpupoor.plan.time.grpo_work import describe_rows, grpo_rows, grpo_step_work
from gpupoor.plan.time.probed import STARTUP_SPREAD, STEP_SPREAD, probed_step, spread, weights_read_s

# Per kind of work: seconds = coefficient x amount x Rates.unit_s(kind) (the amount over the rate measured for
# that kind; a call's measured seconds for `calls`), plus seconds per micro-batch and per step. The CPU's fitted
# by non-negative least squares of the relative error over the 38 calibration runs of bench/time_accuracy.py
# --calibrate on an Intel Xeon with AMX, fp32 and bf16 (none of them in its accuracy table); see
# docs/benchmarks.md, "Time plan accuracy". LoRA and the plain elementwise work fitted at 0: their cost is in
# the calls and the matmuls they ride with on these shapes; a checkpointed forward keeps nothing, so the
# recomputation costs less than a forward (fitted, not assumed).
COEFFICIENTS = {
    "cpu": {"matmul": 1.62, "recompute": 0.469, "attention": 2.0, "lora": 0.0, "elementwise": 0.0, "casts": 3.62,
            "dora": 1.48, "dequantize": 4.36, "optimizer": 4.57, "calls": 3.46, "micro_batch_s": 0.0,
            "step_s": 0.00109, "first_step_s": 0.5,
            # GRPO's sampling (bench/time_accuracy.py --calibrate-grpo): decode fixed at 1 (sampling's matmuls
            # cannot run faster than the same matmul probed alone), the calls and casts fitted with the rest fixed;
            # refitted on the same runs after the review's terms (bench/results/time-2026-11-29-grpo-xeon)
            "decode": 1.0, "decode_calls": 3.71, "decode_steps": 0.0, "decode_casts": 7.75},
    # fitted on the H100's rows (bench/time_accuracy.py --calibrate-gpu bench/results/gpu-2026-11-28): matmul and
    # dequantize; the rest fixed (GPU_FIXED there says why); every kind at the matmul rate (only it is probed)
    "cuda": {"matmul": 3.04, "recompute": 3.04, "attention": 0.0, "lora": 0.0, "elementwise": 2650.0, "casts": 0.0,
             "dora": 2650.0, "dequantize": 3737.0, "optimizer": 544.0, "calls": 1e-5, "micro_batch_s": 0.0,
             "step_s": 0.0, "first_step_s": 1.0,
             # GRPO is not planned on a GPU (gpupoor.plan.make): no GPU run has calibrated its sampling
             "decode": 0.0, "decode_calls": 0.0, "decode_steps": 0.0, "decode_casts": 0.0},
}
# Which measured rate each kind of work is divided by ("call": multiplied by a call's seconds). A rate not measured
# (a GPU: its coefficients are fitted against the matmul rate alone) falls back to the matmul rate, and a call to 1 s.
RATE_OF_KIND = {"matmul": "matmul", "recompute": "matmul", "lora": "lora", "attention": "attention",
                "elementwise": "values", "casts": "values", "dora": "values", "dequantize": "values",
                "optimizer": "optimizer", "calls": "call", "decode": "decode", "decode_calls": "call",
                "decode_steps": "call", "decode_casts": "call"}


@dataclass(frozen=True)
class Rates:
    """What this machine does a second at the run's precision and shapes, each probed once (gpupoor.plan.time.measure)."""

    matmul: float  # FLOP/s of a training-shaped F.linear
    lora: float | None = None  # FLOP/s of LoRA's thin matmuls at the run's rank
    attention: float | None = None  # FLOP/s of training's attention, forward and backward, at the data's lengths
    values: float | None = None  # elementwise values a second (a norm, the gated activation, a residual add)
    optimizer: float | None = None  # parameters a second an AdamW step updates (fp32)
    call: float | None = None  # seconds of a tiny module call, forward and backward
    decode: float | None = None  # FLOP/s of a matmul of GRPO's decode step: as many rows as answers sampled at once

    def unit_s(self, kind: str) -> float:
        """Seconds one unit of `kind` (a FLOP, a value, a call) takes at coefficient 1."""
        which = RATE_OF_KIND[kind]
        if which == "call":
            return self.call or 1.0
        return 1 / (getattr(self, which) or self.matmul)

    def to_json(self) -> dict:
        return asdict(self)


# Loading: seconds per GiB of weight file read (and converted or quantized), beyond a fixed part.
LOAD_S_PER_GIB = {"cpu": 1.5, "cuda": 1.5}
LOAD_FIXED_S = 0.5
SAVE_FIXED_S = 0.3  # a checkpoint's fsyncs, manifest and rename, beyond its bytes
DEFAULT_SAVE_MINUTES = 30  # a recipe with no cadence saves at least this often (gpupoor.run.saving)

# Published dense (no sparsity) tensor-core peaks in TFLOP/s for bf16 (fp16 on GPUs without bf16) from each
# vendor's datasheet: H100 SXM5, H200, A100 SXM4, A10G, L4, L40S, T4, V100 SXM2, RTX 4090, RTX 3090 (its
# fp16 tensor rate with fp32 accumulate), and what each is called in nvidia-smi.
GPU_PEAKS = {
    "H100": (989.4, "NVIDIA H100 SXM5 datasheet, BF16 tensor core, dense"),
    "H200": (989.4, "NVIDIA H200 datasheet, BF16 tensor core, dense"),
    "A100": (312.0, "NVIDIA A100 datasheet, BF16 tensor core, dense"),
    "A10G": (70.0, "NVIDIA A10G (AWS) figures, BF16 tensor core, dense"),
    "L4": (121.0, "NVIDIA L4 datasheet, BF16 tensor core, dense"),
    "L40S": (362.05, "NVIDIA L40S datasheet, BF16 tensor core, dense"),
    "T4": (65.0, "NVIDIA T4 datasheet, FP16 tensor core (no bf16)"),
    "V100": (125.0, "NVIDIA V100 SXM2 datasheet, FP16 tensor core (no bf16)"),
    "RTX4090": (165.2, "NVIDIA Ada whitepaper, RTX 4090, BF16 tensor with FP32 accumulate, dense"),
    "RTX3090": (71.0, "NVIDIA Ampere GA102 whitepaper, RTX 3090, FP16 tensor with FP32 accumulate, dense"),
}
# The share of the published peak a bf16 F.linear at training's shapes reached on the GPU lent here (an H100:
# 697-788 of 989 TFLOP/s at 8192 rows, bench/results/gpu-2026-11-28/gpu.txt): what an on-paper plan takes as
# its probe.
PAPER_PROBE_FRACTION = 0.75


@dataclass
class TimePlan:
    """How long a run takes: its steps, a step's work and time, start-up, saves, and against a time limit."""

    steps: int
    accumulation: int
    batch: BatchFacts
    work: list[Work]
    rates: Rates  # what the step's work is divided by
    step_s: float
    startup_s: float
    first_step_s: float  # the first step's extra (warm-up, allocation)
    saves: int
    save_s: float  # one save
    source: str  # where the figures come from, in one line
    on_paper: bool = False
    measured_step_s: float | None = None  # a train of this very recipe on this machine measured it
    time_limit_s: float | None = None
    notes: list[str] = field(default_factory=list)
    update_tokens: float | None = None  # GRPO: the tokens a micro-batch's update reads (its prompts and answers)
    rows_line: str | None = None  # GRPO: a step's rows in words (the data's rows are prompts, not what trains)
    final_s: float = 0.0  # final/: the trained weights alone, after the last checkpoint
    # The range the total may fall in: the step and start-up at their low and high ends (measured plans: the
    # held-out runs' spread; GRPO: also answers that end early or run to grpo.max_new_tokens)
    step_range_s: tuple[float, float] | None = None
    startup_range_s: tuple[float, float] | None = None
    measured: list[str] = field(default_factory=list)  # what this plan's figures were measured from
    assumed: list[str] = field(default_factory=list)  # what they assume instead

    def _with(self, step_s: float, startup_s: float) -> "TimePlan":
        from dataclasses import replace

        return replace(self, step_s=step_s, startup_s=startup_s, measured_step_s=None, step_range_s=None,
                       startup_range_s=None)

    def ends(self) -> tuple["TimePlan", "TimePlan"]:
        """The plan at the low and the high end of its range (itself twice when it has none)."""
        if self.measured_step_s or self.step_range_s is None:
            return self, self
        startup = self.startup_range_s or (self.startup_s, self.startup_s)
        return (self._with(self.step_range_s[0], startup[0]), self._with(self.step_range_s[1], startup[1]))

    @property
    def total_range_s(self) -> tuple[float, float]:
        low, high = self.ends()
        return low.total_s, high.total_s

    def sessions_range(self) -> tuple[int | None, int | None]:
        """Sessions the run needs at the low and the high end of the range."""
        low, high = self.ends()
        return low.sessions(), high.sessions()

    @property
    def tokens_per_step(self) -> float:
        """The tokens a step trains on: the data's rows, or GRPO's prompts and sampled answers."""
        return (self.update_tokens if self.update_tokens is not None else self.batch.tokens) * self.accumulation

    @property
    def used_step_s(self) -> float:
        """The step time the totals use: a measured one where a train of this recipe here left it."""
        return self.measured_step_s or self.step_s

    @property
    def train_s(self) -> float:
        return self.steps * self.used_step_s + self.first_step_s

    @property
    def total_s(self) -> float:
        return self.startup_s + self.train_s + self.saves * self.save_s + self.final_s

    def sessions(self) -> int | None:
        """Sessions of time_limit_s the run needs, resuming from the checkpoint each one saves before its end."""
        per_session = self.steps_per_session()
        if per_session is None:
            return None
        return max(1, math.ceil(self.steps / per_session)) if per_session > 0 else None

    def steps_per_session(self) -> int | None:
        """Optimizer steps one session of time_limit_s completes: after start-up (a resume loads the same), with
        the reserve training keeps (two saves and a step, gpupoor.run.saving) and its own periodic saves."""
        if self.time_limit_s is None:
            return None
        usable = self.time_limit_s - self.startup_s - self.first_step_s - 2 * self.save_s - self.used_step_s
        per_step = self.used_step_s + self.saves * self.save_s / max(self.steps, 1)
        return max(0, int(usable / per_step))

    def to_json(self) -> dict:
        low, high = self.ends()
        return {"steps": self.steps, "accumulation": self.accumulation, "tokens_per_step": self.tokens_per_step, "micro_batches_per_epoch":
                self.batch.micro_batches, "flops_per_step": total_flops(self.work),
                "work": [{"key": w.key, "kind": w.kind, "amount": w.amount, "detail": w.detail} for w in self.work],
                "rate_flops": self.rates.matmul, "rates": self.rates.to_json(), "step_s": self.step_s, "measured_step_s": self.measured_step_s,
                "startup_s": self.startup_s, "first_step_s": self.first_step_s, "saves": self.saves,
                "save_s": self.save_s, "final_s": self.final_s, "total_s": self.total_s, "source": self.source, "on_paper": self.on_paper,
                "time_limit_s": self.time_limit_s, "sessions": self.sessions(),
                "steps_per_session": self.steps_per_session(), "total_range_s": [low.total_s, high.total_s],
                "step_range_s": [low.used_step_s, high.used_step_s], "startup_range_s": [low.startup_s, high.startup_s],
                "sessions_range": [low.sessions(), high.sessions()], "measured": self.measured, "assumed": self.assumed,
                "notes": self.notes}


def predict_step_s(work: list[Work], rates: Rates, accumulation: int, device: str) -> float:
    c = COEFFICIENTS["cuda" if device == "cuda" else "cpu"]
    return (sum(c[w.kind] * w.amount * rates.unit_s(w.kind) for w in work)
            + c["micro_batch_s"] * accumulation + c["step_s"])


def make_time_plan(shape, settings, recipe, batch: BatchFacts, *, rates: Rates, source: str, processes: int,
                   import_s: float, weight_file_bytes: int, checkpoint_bytes: int, write_rate: float,
                   on_paper: bool = False, measured_step_s: float | None = None,
                   time_limit_s: float | None = None, probe: dict | None = None, load: dict | None = None,
                   cli_s: float | None = None, first_tokens: list | None = None,
                   tokenizer_s: float | None = None, final_bytes: int = 0) -> TimePlan:
    """The time plan of `recipe` on `settings.device` from the measured (or on-paper) facts. `probe`: the recipe's
    steps measured at two depths (gpupoor.run.step_probe), the plan's step and start-up where given; `load`: the
    real weights' load measured by parts; `cli_s`: this command's own start before the plan (the same Python,
    command line and recipe checks a `train` runs first)."""
    training = recipe.training
    accumulation = training.gradient_accumulation_steps
    steps = count_steps(training.max_steps, training.epochs, accumulation, batch.micro_batches, processes)
    work = (grpo_step_work if settings.sampled_answers else step_work)(shape, settings, batch, accumulation)
    step_s = predict_step_s(work, rates, accumulation, settings.device)
    device = "cuda" if settings.device == "cuda" else "cpu"
    startup_s = import_s + LOAD_FIXED_S + LOAD_S_PER_GIB[device] * weight_file_bytes / 2**30
    save_s = SAVE_FIXED_S + checkpoint_bytes / write_rate
    plan = TimePlan(steps, accumulation, batch, work, rates, step_s, startup_s, COEFFICIENTS[device]["first_step_s"],
                    0, save_s, source, on_paper, measured_step_s, time_limit_s)
    if probe is not None:
        _use_probe(plan, shape, settings, rates, probe, load, cli_s, import_s, weight_file_bytes, first_tokens,
                   tokenizer_s)
    else:
        plan.step_range_s = spread(plan.step_s, FITTED_SPREAD)
        plan.startup_range_s = spread(plan.startup_s, FITTED_SPREAD)
        plan.assumed.append("every kind of work at its probe's rate x efficiencies fitted on another machine "
                            f"(range +/-{FITTED_SPREAD:.0%})" if not on_paper else "a published peak")
    plan.saves = count_saves(recipe, steps, plan.used_step_s) + 1  # and the last step's checkpoint
    # final/ after it: the trained weights alone, at the checkpoint's pace (its share of the checkpoint's bytes)
    plan.final_s = SAVE_FIXED_S + (plan.save_s - SAVE_FIXED_S) * final_bytes / max(checkpoint_bytes, 1)
    if settings.sampled_answers:
        _, length, update = grpo_rows(settings, batch)
        plan.update_tokens, plan.rows_line = update.tokens, describe_rows(settings, length, update, accumulation)
    return plan


# A plan from the fitted efficiencies alone (nothing measured at the recipe's shapes): its range either way.
FITTED_SPREAD = 0.4


def _use_probe(plan: TimePlan, shape, settings, rates: Rates, probe: dict, load: dict | None, cli_s: float | None,
               import_s: float, weight_bytes: int, first_tokens: list | None, tokenizer_s: float | None) -> None:
    """The step, its range and the start-up from the measured probe (gpupoor.plan.time.probed)."""
    optimizer = sum(COEFFICIENTS["cpu"][w.kind] * w.amount * rates.unit_s(w.kind) for w in plan.work
                    if w.kind == "optimizer") if settings.device == "cpu" else 0.0
    grpo = bool(settings.sampled_answers)
    step = probed_step(probe, accumulation=plan.accumulation, optimizer_s=optimizer,
                       epoch_tokens=None if grpo else plan.batch.tokens, first_tokens=None if grpo else first_tokens,
                       quantized=bool(settings.bits))
    if step.save_s is not None:  # serializing, checksums and the fsyncs, measured: not the disk's rate alone
        plan.save_s = max(plan.save_s, step.save_s)
    low, high = spread(step.step_s, STEP_SPREAD)
    point = step.step_s
    if grpo:  # the probe's random weights answer to max_new_tokens; a trained model's answers end earlier
        shortest, halfway = _answer_shares(shape, settings, plan, rates)
        point, low = step.step_s * halfway, low * shortest
        plan.assumed.append(f"answers halfway between the data's own answers ({_reference_tokens(settings, plan.batch):.0f}"
                            f" tokens) and grpo.max_new_tokens ({settings.new_tokens}); the range spans both")
    plan.step_s, plan.step_range_s = point, (low, high)
    plan.first_step_s = step.first_step_extra_s
    read = weights_read_s(load, weight_bytes)
    parts = sum(step.startup_parts.values()) + (tokenizer_s or 0.0)  # the probe's runs reused the data's tokenizer
    cli = cli_s if cli_s is not None else LOAD_FIXED_S
    weights = read if read is not None else LOAD_S_PER_GIB["cpu"] * weight_bytes / 2**30
    plan.startup_s = cli + import_s + parts + step.build_s + weights
    plan.startup_range_s = spread(plan.startup_s, STARTUP_SPREAD)
    plan.measured.append(f"a step: the recipe trained {len(probe['depths'][0]['step_s'])} steps at {step.depths[0]} and "
                         f"{step.depths[1]} of its {probe['layers']} layers (random weights), extrapolated: "
                         f"{step.rest_s:.3g} s + {step.layer_s:.3g} s a layer a micro-batch (probe {step.probe_s:.0f} s)")
    plan.measured.append(f"start-up: the libraries' import {import_s:.1f} s, "
                         + (f"the tokenizer {tokenizer_s:.1f} s, " if tokenizer_s is not None else "")
                         + ", ".join(f"{part} {seconds:.1f} s" for part, seconds in step.startup_parts.items())
                         + f", the model built {step.build_s:.1f} s"
                         + (f", its weights read {read:.1f} s" if read is not None else "")
                         + (f", this command's own start {cli_s:.1f} s" if cli_s is not None else ""))
    if read is None:
        plan.assumed.append(f"the weights read at {1 / LOAD_S_PER_GIB['cpu']:.2g} GiB/s (not measured)")
    if cli_s is None:
        plan.assumed.append(f"Python and the command line start in {LOAD_FIXED_S:g} s")


def _reference_tokens(settings, batch: BatchFacts) -> float:
    """The data's own answers' mean length in tokens (a GRPO row's targets), at least one, at most max_new_tokens."""
    return min(max(batch.targets / max(settings.prompt_rows, 1), 1.0), settings.new_tokens)


def _answer_shares(shape, settings, plan: TimePlan, rates: Rates) -> tuple[float, float]:
    """A GRPO step with answers as long as the data's own, and halfway to max_new_tokens, against one with every
    answer max_new_tokens long: the work model's ratios (what the probe measured is the last)."""
    from dataclasses import replace

    def step_at(tokens: float) -> float:
        changed = replace(settings, new_tokens=max(1, round(tokens)))
        return predict_step_s(grpo_step_work(shape, changed, plan.batch, plan.accumulation), rates, plan.accumulation,
                              settings.device)

    full = step_at(settings.new_tokens)
    reference = _reference_tokens(settings, plan.batch)
    return step_at(reference) / full, step_at((reference + settings.new_tokens) / 2) / full


def count_saves(recipe, steps: int, step_s: float) -> int:
    """Periodic checkpoints in a run of `steps` (the last step's save is final/'s, counted by the caller)."""
    cadence = recipe.checkpoint
    by_steps = (steps - 1) // cadence.every_steps if cadence.every_steps else 0
    minutes = cadence.every_minutes or (None if cadence.every_steps else DEFAULT_SAVE_MINUTES)
    by_time = int(steps * step_s / (60 * minutes)) if minutes else 0
    return max(by_steps, by_time)
