"""What a run tells as it goes: each record to metrics.jsonl (the record of truth) and the trackers, the progress
line, the memory line after the first and third steps, the warning for a skipped non-finite step, and the
profiler's step. The first process writes; the others keep the same state (the last loss) and write nothing."""

from __future__ import annotations

import statistics
import time

from gpupoor.objective_table import steps_per_sampling
from gpupoor.recipe.schema import Recipe
from gpupoor.run.session import Session


SAMPLES_FILE = "samples.jsonl"  # GRPO's sampled answers with their rewards, one group per line
TIME_CHECK_STEPS = 5  # steps before the step time is compared with the plan's: the first one warms up


def sampling_cycle(recipe: Recipe) -> int:
    """Steps per sampling: grpo.iterations for GRPO (each sampled rollout is updated on that many steps), else 1."""
    return steps_per_sampling(recipe)


def time_check_steps(cycle: int) -> int:
    """Steps before the step time is compared with the plan's: TIME_CHECK_STEPS, or the first step and two whole
    cycles when a cycle is longer (the time line needs two cycles' means to take a median of)."""
    return max(TIME_CHECK_STEPS, 1 + 2 * cycle)


def typical_step_s(step_times: list[float], cycle: int = 1) -> float | None:
    """A session's step time as the plan means it: the median after the first step (it warms up). With a cycle of
    N > 1 steps (GRPO samples once every grpo.iterations steps) the median of the means of N steps in a row: any
    N consecutive steps hold one sampling, and a median of single steps would be an update alone."""
    rest = step_times[1:]
    means = [sum(rest[i:i + cycle]) / cycle for i in range(0, len(rest) - cycle + 1, cycle)]
    return statistics.median(means) if means else None


class Reporter:
    """The run's metrics writer, trackers and progress line, and what it last reported."""

    def __init__(self, session: Session, *, resumed: bool = False):
        from gpupoor.train.metrics import MetricsWriter, NullWriter, Progress

        self.session = session
        self.first_step = session.state.step  # the step this process started from
        self.last_loss: float | None = None
        self.warned_nonfinite = False
        self.step_times: list[float] = []  # this session's step_s, for the time line and the facts cache
        self.cycle = sampling_cycle(session.recipe)
        self.check_steps = time_check_steps(self.cycle)
        self.predicted_mb = (round(session.memory_plan.comparable_peak / 2**20, 1)
                             if session.memory_plan is not None else None)
        main = session.main
        self.metrics = MetricsWriter(session.run_dir / "metrics.jsonl") if main else NullWriter()
        self.progress = Progress(session.steps, session.state.step, session.recipe.logging.progress if main else "none",
                                 session.recipe.logging.every_steps)
        self.trackers = self.profiler = None
        if main and session.recipe.logging.report_to:
            from gpupoor.train.trackers import Trackers

            self.trackers = Trackers(session.run_dir, session.recipe.logging, session.recipe.model_dump(mode="json"),
                                     session.logged, lambda text: self.progress.message(text, always=True))
        # total_steps: `gpupoor status` shows an epoch-based run's step count and ETA from its first step on.
        self.write({"step": self.first_step, "event": "start", "session": "resume" if resumed else "train",
                    "time": round(time.time(), 3), "total_steps": session.steps,
                    "startup_s": session.startup.seconds()})

    def write(self, record: dict) -> None:
        """One record to metrics.jsonl (the record of truth) and to the trackers."""
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def message(self, text: str, always: bool = False) -> None:
        self.progress.message(text, always=always)

    def step(self, record: dict, state) -> None:
        """An optimizer step's record, with the memory plan's prediction (and after steps 1 and 3 the memory line,
        after time_check_steps the step time against the time plan's)."""
        if self.predicted_mb is not None:
            record["predicted_peak_mb"] = self.predicted_mb
        if state.step - self.first_step in (1, 3) and self.session.main:
            self._memory_line(record, state.step)
        if "step_s" in record:
            self.step_times.append(record["step_s"])
        if state.step - self.first_step == self.check_steps and self.session.main:
            self._time_line(record)
        self.last_loss = record["loss"]
        self.write(record)
        self._samples(state.step)
        if record.get("nonfinite") and not self.warned_nonfinite:  # once per session; the end repeats the count
            self.warned_nonfinite = True
            self.progress.message(f"warning: step {record['step']} was skipped: its loss ({record['loss']:.4g}) or "
                                  f"gradient norm ({record['grad_norm']:.4g}) is not finite. "
                                  f"{nonfinite_advice(self.session.recipe)}", always=True)
        self.progress.step(record)
        if self.profiler is not None:
            self.profiler.step(record)

    def _samples(self, step: int) -> None:
        """GRPO: at each log step, the first prompt's sampled answers with their rewards to samples.jsonl."""
        source = self.session.samples_from
        if not (source and self.session.main and step % self.session.recipe.logging.every_steps == 0):
            return
        import json

        with open(self.session.run_dir / SAMPLES_FILE, "a") as out:
            for group in source.samples:
                out.write(json.dumps(group) + "\n")

    def _memory_line(self, record: dict, step: int) -> None:
        """After the first step (optimizer state now exists) and the third (the heap has settled)."""
        from gpupoor.train.optim import optimizer_state_bytes

        if step - self.first_step == 1:
            record["optimizer_state_mb"] = round(optimizer_state_bytes(self.session.optimizer) / 2**20, 2)
        what = "process RSS" if self.session.device == "cpu" else "allocated, without context and allocator slack"
        planned = self.predicted_mb
        versus = "" if planned is None else \
            f" vs {planned:.0f} MiB planned ({record['peak_mem_mb'] / planned - 1:+.0%}; {what})"
        state_text = f"optimizer state {record['optimizer_state_mb']:.1f} MiB; " if "optimizer_state_mb" in record else ""
        self.progress.message(f"  {state_text}peak memory after step {step}: {record['peak_mem_mb']:.0f} MiB{versus}",
                              always=True)

    def _time_line(self, record: dict) -> None:
        """The measured step time (typical_step_s) against the plan's, and into the time facts cache, so the next
        `gpupoor plan` of this recipe on this machine uses it."""
        measured = typical_step_s(self.step_times, self.cycle)
        plan = self.session.memory_plan
        timing = getattr(plan, "time", None)
        if timing is not None:
            record["predicted_step_s"] = round(timing.step_s, 4)
            versus = f" vs {timing.step_s:.3g} s planned ({measured / timing.step_s - 1:+.0%})"
        else:
            versus = " (no time plan: `gpupoor plan RECIPE` first measures what it needs)"
        steps = f"steps {self.first_step + 2}-{self.first_step + self.check_steps}"
        over = f"median of {steps}" if self.cycle == 1 else \
            f"median of the means of {self.cycle} steps in a row, {steps}: one samples, {self.cycle - 1} reuse"
        self.progress.message(f"  step time {measured:.3g} s ({over}){versus}", always=True)
        startup = self._startup_s()
        if timing is not None and startup is not None and self.first_step == 0:
            self.progress.message(f"  start-up {startup:.3g} s vs {timing.startup_s:.3g} s planned "
                                  f"({startup / timing.startup_s - 1:+.0%})", always=True)
        self._record_step_time(measured)

    def _startup_s(self) -> float | None:
        """The start-up as the plan means it: every part of the clock but the time plan's own measuring. None where
        the clock did not start with the process (a program or the demo calling gpupoor: its imports came before)."""
        parts = self.session.startup.seconds() if self.session.startup is not None else {}
        if "python and cli" not in parts:
            return None
        return sum(seconds for part, seconds in parts.items() if part != "time plan")

    def _record_step_time(self, measured: float | None) -> None:
        keys = getattr(self.session.memory_plan, "time_keys", None)
        if keys is None or measured is None:
            return
        from gpupoor.plan.time.facts import record_step_time

        timing = getattr(self.session.memory_plan, "time", None)
        startup = self.session.startup.seconds() if self.session.startup is not None else {}
        # a run's imports, for the next plan's start-up (which adds its own command's start): only where the clock
        # started with the process (in a program or the demo, torch was imported before it)
        imports = startup.get("libraries") if "python and cli" in startup else None
        record_step_time(*keys, measured, timing.step_s if timing else None, imports)

    def close(self) -> None:
        if self.session.main and len(self.step_times) > self.check_steps:
            # the whole session's step time: the figure the next plan uses
            self._record_step_time(typical_step_s(self.step_times, self.cycle))
        self.progress.close()
        if self.trackers is not None:
            self.trackers.close()
        self.metrics.close()


def nonfinite_advice(recipe: Recipe) -> str:
    training = recipe.training
    clip = "" if training.max_grad_norm else ", set training.max_grad_norm (e.g. 1.0)"
    return f"Lower training.learning_rate (now {training.learning_rate:g}){clip}, or look for bad rows in the data"
