"""The startup summary: what was chosen and why (device, precision, attention, processes, loss, method), the data,
the steps, the memory plan, where a resume starts and where the start-up seconds went."""

from __future__ import annotations

from gpupoor.method_table import METHODS
from gpupoor.run.session import Session


def _dequantized(recipe, precision: str) -> str:
    """For a GGUF base: the tensor types its weights were dequantized from (read again from the cached metadata)."""
    from pathlib import Path

    from gpupoor.model import gguf
    from gpupoor.model.builtin import resolve_model_path

    local = resolve_model_path(gguf.joined(recipe.model.name_or_path, getattr(recipe.model, "gguf_file", None)), Path.cwd())
    if local is None or not gguf.is_gguf(str(local)):
        return ""
    return f" (GGUF, dequantized from {gguf.read_gguf(local).quantization} to {precision})"


def print_summary(session: Session, *, say, checkpoint, loss_path: str) -> None:
    """The startup summary: what was chosen and why, the data, the steps, the memory plan."""
    recipe, data, choices, summary = session.recipe, session.data, session.choices, session.summary
    stats, processes = data.train.stats, session.accelerator.num_processes
    verb = "smoke test" if session.smoke else ("resume" if checkpoint is not None else "train")
    say(f"gpupoor {verb}: {recipe.model.name_or_path}" + (" (shrunken random-weight copy)" if session.smoke else "")
        + _dequantized(recipe, choices["precision"].value))
    say("  " + "; ".join(f"{name} {choices[name].value} ({choices[name].reason})"
                         for name in ("device", "threads", "precision", "attention") if name in choices))
    strategy = choices["strategy"]
    nodes = f" on {session.nodes} nodes" if session.nodes > 1 else ""
    say(f"  processes: {processes}{nodes}" + (f" ({strategy.value.upper()}, {session.accelerator.state.backend}; "
                                               f"{strategy.reason})" if processes > 1 else " (no data parallelism)"))
    checkpointing = {False: "off", True: "on (non-reentrant)",
                     "offload": "on, layer inputs offloaded to CPU" if session.device == "cuda"
                     else "on (offload has no effect on a CPU)"}[recipe.memory.gradient_checkpointing]
    say(f"  loss: {loss_path}; gradient checkpointing: {checkpointing}")
    fused = choices["fused"]
    say(f"  fused layers: {fused.value} ({fused.reason})")
    if choices["kernels"].value != "none":
        say(f"  kernels: {choices['kernels'].reason}")
    peft = recipe.peft
    scope = [f"the last {peft.last_layers} decoder layers" if peft.last_layers else
             ("" if not METHODS[peft.method].adapter and peft.modules_to_save else "every decoder layer")] + peft.modules_to_save
    quant = recipe.quantization
    # QLoRA is LoRA on a quantized base: say so here, where a reader looks for what is trained on what.
    base = "" if quant.bits is None else (
        ", base quantized to 8-bit" if quant.bits == 8 else
        f", base quantized to 4-bit {quant.quant_type}{' with double quant' if quant.double_quant else ''}")
    say(f"  method {peft.method} on {' and '.join(filter(None, scope))}{base}; parameters {summary.total_params:,}; trainable "
        f"{summary.trainable_params:,} ({summary.trainable_percent:.2f}%); weights {summary.weight_bytes / 2**20:.1f} MiB")
    noun = "preference pairs" if data.pairs else "examples"
    say(f"  data {stats.kept} {noun} ({stats.rows} rows; {stats.truncated} truncated to "
        f"{recipe.data.max_length} tokens; {stats.dropped_no_target} without targets dropped); "
        f"{stats.target_tokens / max(stats.tokens, 1):.0%} of tokens are targets"
        + ("; tokenized cache hit" if data.cache_hit else "")
        + (f"; eval {len(data.eval)} {noun}" if data.eval is not None else ""))
    mixture = data.mixture
    if mixture is not None and len(mixture.sources) > 1:
        for source, part in zip(mixture.sources, data.source_stats):
            say(f"    source {source.name}: {part.rows} rows, {source.size} examples, {part.tokens:,} tokens "
                f"({part.target_tokens:,} targets); {source.count} examples per epoch"
                + (f"; eval {source.eval_end - source.eval_start}" if source.eval_end > source.eval_start else ""))
    sampler = choices["sampler"]
    # Packed, a micro-batch is rows holding as many whole examples (pairs) as fit: say how many that makes.
    per_batch = f" (about {len(data.train) / max(len(data.plan), 1):.1f} {noun} each)" if sampler.value == "packed" else ""
    unit = (f"{recipe.training.micro_batch_size} packed rows of up to {data.plan.row_length} tokens{per_batch}"
            if sampler.value == "packed" else f"{recipe.training.micro_batch_size} {noun}")
    say(f"  {session.steps} optimizer steps of {recipe.training.gradient_accumulation_steps} x {unit}; "
        f"{len(data.plan)} micro-batches per epoch; sampler {sampler.value} ({sampler.reason})")
    if session.memory_plan is not None:
        from gpupoor.units import format_bytes

        plan = session.memory_plan
        fits = "" if plan.fits is None else (" (fits)" if plan.fits else " (predicted NOT to fit)")
        say(f"  memory plan: peak {format_bytes(plan.peak)} on {plan.device}{fits}; "
            f"activations {format_bytes(next(t.bytes for t in plan.terms if t.key == 'activations'))} "
            "(gpupoor plan RECIPE for every term)")
        if getattr(plan, "time", None) is not None:
            say(f"  {time_plan_line(plan.time)}")
    if checkpoint is not None:
        state = session.state
        say(f"  resuming from {checkpoint.path.name}: step {state.step}, epoch {state.epoch}, "
            f"micro-batch {state.batch_in_epoch} of the epoch")
    say(f"  run directory {session.run_dir}")
    if "tensorboard" in (recipe.logging.report_to or []):
        say(f"  tensorboard: tensorboard --logdir {session.run_dir / 'tensorboard'}")
    if session.startup is not None:
        say(f"  {session.startup.line()}")


def time_plan_line(t) -> str:
    """The time plan in one line: a step, the total and its range, the sessions a time limit needs."""
    from gpupoor.units import format_duration

    def age(seconds: float) -> str:
        return format_duration(seconds, style="age")

    low, high = t.total_range_s
    likely = f" (likely {age(low)} to {age(high)})" if high > low else ""
    line = f"time plan: {t.steps:,} steps of {t.used_step_s:.3g} s, start-up {t.startup_s:.3g} s: {age(t.total_s)}{likely}"
    if t.time_limit_s is not None and t.sessions():
        fewest, most = t.sessions_range()
        line += f"; {t.sessions()} session{'s' if t.sessions() > 1 else ''} of {age(t.time_limit_s)}" + (
            f" ({fewest} to {most})" if fewest and most and fewest != most else "")
    return line
