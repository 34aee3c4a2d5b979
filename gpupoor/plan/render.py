"""The plan in words: the method line, the table of terms, the verdict, each strategy's fit and what to change."""

from __future__ import annotations

import json

from gpupoor.method_table import METHODS
from gpupoor.objective_table import objective_of
from gpupoor.plan.result import Plan, StrategyFit
from gpupoor.plan.settings import Settings, what_trains
from gpupoor.model.shape import Shape
from gpupoor.recipe.schema import Recipe
from gpupoor.units import format_bytes


def describe_method(shape: Shape, s: Settings) -> str:
    """The plan's method line: what trains and how many parameters."""
    training = what_trains(shape, s)
    name = training.method + (f" (rank {s.rank})" if METHODS[training.method].low_rank else "")
    count = f"{training.params:,} trainable parameters"
    if training.scope == "all":
        return f"method {name}: {count} (all)"
    share = training.params / shape.total_params
    return f"method {name} on {training.scope}: {count} ({share:.2%} of the model's {shape.total_params:,})"


def describe_preference(recipe: Recipe, s: Settings) -> str:
    """The plan's line for an objective other than sft: pairs and DPO's reference, or GRPO's answers."""
    objective = objective_of(recipe)
    if objective.samples:
        grpo = recipe.grpo
        reference = "the model with its adapter switched off" if grpo.beta else "none (beta 0)"
        return (f"GRPO: {grpo.group_size} answers of up to {grpo.max_new_tokens} tokens to each of "
                f"{recipe.training.micro_batch_size} prompts per micro-batch; reference: {reference}")
    pairs = "pairs of sequences of up to data.max_length each"
    if not objective.reference:
        return f"{objective.title} on {pairs} (no reference model)"
    where = {"adapter_off": "the model with its adapter switched off", "copy": "a frozen copy of the base"}
    return f"{objective.title} on {pairs}; reference: {where[s.reference]}"


def render(plan: Plan, recipe_name: str) -> str:
    several = "" if plan.processes == 1 else (
        f", one of {plan.processes} processes on {plan.nodes} node{'s' * (plan.nodes > 1)} ({plan.strategy})")
    lines = [f"memory plan for {recipe_name} on {plan.device} ({plan.precision}){several}, at the peak of a "
             "training step:"]
    if plan.method_detail:
        lines.append(f"  {plan.method_detail}")
    width = max(len(t.key) for t in plan.terms)
    for term in plan.terms:
        lines.append(f"  {term.key:<{width}}  {format_bytes(term.bytes):>10}  {term.detail}")
    lines.append(f"  {'peak':<{width}}  {format_bytes(plan.peak):>10}" + (" per process" if several else ""))
    if plan.offloaded:
        lines.append(f"  in CPU memory (distributed.cpu_offload), not in the peak: "
                     f"{format_bytes(sum(t.bytes for t in plan.offloaded))} per process ("
                     + ", ".join(f"{t.key} {format_bytes(t.bytes)}" for t in plan.offloaded) + ")")
    if plan.memory is None:
        lines.append(f"fits: unknown ({plan.memory_source})")
    else:
        verdict = "yes" if plan.fits else "NO"
        held = plan.peak * plan.share
        together = f"{plan.share} x {format_bytes(plan.peak)}" if plan.share > 1 else format_bytes(plan.peak)
        lines.append(f"fits: {verdict}: {together} of {format_bytes(plan.memory)} "
                     f"({plan.memory_source}), {held / plan.memory:.0%}")
        lines += render_strategies(plan)
    for note in plan.assumptions:
        lines.append(f"  assumes {note}")
    advice = render_suggestions(plan)
    timing = render_time(plan)
    return "\n".join(lines + ([advice] if advice else []) + ([timing] if timing else []))


AMOUNT_UNITS = {"matmul": "FLOP", "recompute": "FLOP", "attention": "FLOP", "lora": "FLOP", "decode": "FLOP"}


def render_time(plan: Plan) -> str:
    """The time plan: the run's steps and tokens, a step's work term by term, the predicted times and, with a time
    limit, the sessions it needs."""
    if plan.time_error:
        return f"time plan: none ({plan.time_error})"
    t = plan.time
    if t is None:
        return ""
    from gpupoor.plan.time.work import total_flops
    from gpupoor.units import format_duration

    def _age(seconds: float) -> str:
        return format_duration(seconds, style="age")

    b = t.batch
    epoch = f"{b.micro_batches:,} micro-batches an epoch"
    rows = (f"{t.rows_line} ({epoch})" if t.rows_line else
            f"{t.accumulation} x {b.tokens:,.0f} tokens ({b.real_tokens / max(b.tokens, 1):.0%} data, "
            f"{b.targets:,.0f} targets a micro-batch; {epoch})")
    lines = [f"time plan{' on paper' if t.on_paper else ''}: {t.steps:,} optimizer steps of {rows}",
             f"  work of a step: {total_flops(t.work) / 1e12:,.3g} TFLOP"]
    width = max(len(w.key) for w in t.work)
    for w in t.work:
        amount = (f"{w.amount / 1e9:>10,.1f} GFLOP" if w.kind in AMOUNT_UNITS else
                  f"{w.amount:>10,.0f} calls" if w.kind in ("calls", "decode_calls", "decode_casts") else
                  f"{w.amount:>10,.0f} steps" if w.kind == "decode_steps" else f"{w.amount / 1e6:>8,.1f}M values")
        lines.append(f"  {w.key:<{width}}  {amount}  {w.detail}")
    measured = f" (measured by train here: {t.measured_step_s:.3g} s)" if t.measured_step_s else ""
    total_low, total_high = t.total_range_s
    lines.append(f"  step {t.used_step_s:.3g} s{_step_range(t)}{measured}; start-up {t.startup_s:.3g} s; {t.saves} saves of "
                 f"{t.save_s:.2g} s and final/ {t.final_s:.2g} s; total {_age(t.total_s)}" + (
                     f" (likely {_age(total_low)} to {_age(total_high)})" if total_high > total_low else ""))
    if t.measured:
        lines.extend(f"  measured: {what}" for what in t.measured)
    else:
        lines.append(f"  from {t.source}")
    lines.extend(f"  assumes: {what}" for what in t.assumed)
    if t.time_limit_s is not None:
        sessions, per = t.sessions(), t.steps_per_session()
        fewest, most = t.sessions_range()
        limit = _age(t.time_limit_s)
        likely = f" (likely {fewest} to {most})" if fewest and most and fewest != most else ""
        if not per:
            lines.append(f"  time limit {limit}: too short for one step after start-up and the save reserve")
        elif sessions == 1:
            lines.append(f"  time limit {limit}: finishes in one session ({_age(t.total_s)})"
                         + (f"; at the slow end of the range it needs {most}" if most and most > 1 else ""))
        else:
            lines.append(f"  time limit {limit}: NEEDS {sessions} sessions{likely}: each saves a checkpoint after "
                         f"about {per:,} steps and stops; `gpupoor resume` goes on from there")
    for note in t.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def _step_range(t) -> str:
    """The step's range in words (" (3.5-4.8 s)"), empty where it has none."""
    if t.measured_step_s or t.step_range_s is None:
        return ""
    low, high = t.step_range_s
    return f" ({low:.3g}-{high:.3g} s)"


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{key}: {value if isinstance(value, str) else json.dumps(value)}"
                     for key, value in changes.items())


def render_strategies(plan: Plan) -> list[str]:
    """Several processes and a known memory: each strategy's per-process peak, and which one lets it fit."""
    if not plan.strategies:
        return []
    lines = [f"per process with each distributed.strategy ({plan.processes} processes):"]
    for name, fit in plan.strategies.items():
        also = f"  (with {_changes_text(fit.changes)})" if fit.changes else "  (this recipe)"
        lines.append(f"  {name:<5} {format_bytes(fit.peak):>10}  {'fits' if fit.fits else 'does not fit'}{also}")
    ddp, fsdp = plan.strategies["ddp"], plan.strategies["fsdp"]

    def named(name: str, fit: StrategyFit) -> str:
        return _changes_text({"distributed.strategy": name, **fit.changes})

    if ddp.fits and fsdp.fits:  # ddp moves only gradients: the faster while the whole model fits each process
        lines.append(f"fits with {named('ddp', ddp)} ({format_bytes(ddp.peak)} per process; the faster) and with "
                     f"fsdp ({format_bytes(fsdp.peak)})")
    elif ddp.fits or fsdp.fits:
        (good, fit), (bad, miss) = sorted(plan.strategies.items(), key=lambda item: not item[1].fits)
        lines.append(f"fits with {named(good, fit)} ({format_bytes(fit.peak)} per process), not with {bad} "
                     f"({format_bytes(miss.peak)})")
    else:
        lines.append(f"fits with neither ddp ({format_bytes(ddp.peak)} per process) nor fsdp "
                     f"({format_bytes(fsdp.peak)})")
    return lines


def render_suggestions(plan: Plan) -> str:
    if not plan.suggestions:
        return ""
    lines = ["what to change (cheapest first; predicted peak after the change):"]
    for s in plan.suggestions:
        change = ", ".join(f"{k}: {json.dumps(v)}" for k, v in s.changes.items())
        lines.append(f"  {change:<58} -{format_bytes(s.saving)} -> {format_bytes(s.peak)}; cost: {s.cost}")
    if plan.fit_changes:
        change = ", ".join(f"{k}: {json.dumps(v)}" for k, v in plan.fit_changes.items())
        lines.append(f"  the cheapest set that fits: {change} (gpupoor plan --fit writes it)")
    else:
        lines.append("  no combination of these fits: a GPU with more memory, or a smaller model")
    return "\n".join(lines)
