"""The training loop: one function, read top to bottom. No file I/O and no recipe parsing: what happens at
each step boundary (metrics, progress, checkpoints, stopping) is decided by the hooks it is given."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from gpupoor.data.build import DataBundle, count_targets, count_tokens
from gpupoor.train.distributed import full_value
from gpupoor.objectives.cross_entropy import plain_eval_sums, plain_loss_sum
from gpupoor.profiling import span
from gpupoor.train.heap import heap_trimmer
from gpupoor.train.state import TrainState


@dataclass
class LoopSettings:
    total_steps: int  # optimizer steps to reach
    accumulation: int  # micro-batches per optimizer step
    max_grad_norm: float | None
    eval_every: int | None
    pad_id: int
    eval_micro_batch_size: int
    eval_in_train_mode: bool = False  # gpupoor.decisions.evaluates_in_train_mode: quantized layers on the CPU
    max_consecutive_skips: int = 10
    loss_fn: Callable = plain_loss_sum  # (model, batch) -> summed loss over target tokens
    # (model, batch) -> (summed cross-entropy, targets ranked first): eval_loss and eval_accuracy. The training
    # loss may differ (distillation); eval is always the cross-entropy, comparable across runs.
    eval_fn: Callable = plain_eval_sums
    lockstep: bool = False  # FSDP: every forward is collective, so every process runs as many eval forwards
    # What the loss is a sum over, and so what the window's loss is divided by: target tokens (a token-level loss),
    # or preference pairs (gpupoor.data.build.count_pairs), so that every unit weighs the same however the batch
    # was split over micro-batches and processes.
    count_units: Callable = count_targets
    # Names of the further sums loss_fn and eval_fn return beside the loss (then they return (loss, {name: sum})
    # and (loss, right, {name: sum})): summed over the window and the processes, divided by the units, recorded
    # in each step record (and with an eval_ prefix in each eval record). Empty for the token-level losses.
    metric_names: tuple[str, ...] = ()
    eval_metric_names: tuple[str, ...] | None = None  # eval_fn's own names when they differ (None: metric_names)
    # Optimizer steps on each window of micro-batches (GRPO's grpo.iterations): the data position moves on every
    # `window_repeats` steps; the steps between take the same window again (from TrainState.window_start).
    window_repeats: int = 1


class TooManySkippedSteps(RuntimeError):
    """The loss or gradient norm was non-finite for too many optimizer steps in a row."""


@dataclass
class Hooks:
    on_step: Callable[[dict, TrainState], None]  # after every optimizer step, with its metrics record
    on_eval: Callable[[dict, TrainState], None]
    should_stop: Callable[[TrainState, float], str | None]  # (state, last step seconds) -> reason to stop


def micro_batches(data: DataBundle, epoch: int, position: int) -> Iterator[tuple[int, int, list[int]]]:
    """(epoch, position) *after* taking it, and the example indices of each micro-batch, starting at a saved
    position and running across epochs (whose plans may differ in length when packing)."""
    while True:
        plan = data.plan.epoch(epoch)
        for index in range(position, len(plan)):
            yield (epoch, index + 1) if index + 1 < len(plan) else (epoch + 1, 0), plan[index]
        epoch, position = epoch + 1, 0


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # This process's own high-water mark of resident memory. Not getrusage's ru_maxrss: on Linux it carries over
    # the high-water mark of the process this one was forked from (a notebook or benchmark that launched
    # gpupoor with subprocess reports its own size as gpupoor's peak).
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux and BSD report KiB


def _schedule_step(scheduler) -> None:
    """The schedule follows the step count, skipped steps included. torch warns that the optimizer has not
    stepped yet when the first step was skipped (a non-finite loss, fp16's scaler backing off): here that is the
    design, not the ordering mistake the warning is about."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


def evaluate(model, accelerator, data: DataBundle, settings: LoopSettings) -> dict:
    """{"eval_loss": mean loss per unit (the cross-entropy per target token), "eval_accuracy": share of units
    right (targets ranked first; preference pairs with a positive reward margin), and eval_ + each metric."""
    assert data.eval is not None
    # Evaluation must not move the training RNG (dropout in train-mode eval would), or a run that evaluated
    # at step k and one resumed from step k would diverge.
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _evaluate(model, accelerator, data, settings)


def _evaluate(model, accelerator, data: DataBundle, settings: LoopSettings) -> dict:
    # The bare model, not its DDP wrapper: DDP's forward syncs buffers with every process, and a process with no
    # eval batch of its own would leave the others waiting in that collective.
    model = accelerator.unwrap_model(model)
    model.train(settings.eval_in_train_mode)
    groups = data.eval_groups()
    names = settings.metric_names if settings.eval_metric_names is None else settings.eval_metric_names
    # loss, right, units, then each metric
    sums = torch.zeros((len(groups), 3 + len(names)), dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for group, start, end in _eval_batches(groups, accelerator, settings):
            batch = data.collate_eval(list(range(start, end)), settings.pad_id)
            units = float(settings.count_units(batch))
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.autocast():
                loss, right, *metrics = settings.eval_fn(model, batch)
            if group is not None:
                extra = [metrics[0][name].double() for name in names] if names else []
                sums[group] += torch.stack([loss.double(), right.double(),
                                            torch.tensor(units, device=sums.device), *extra])
    model.train()  # the same module object the caller trains, wrapped or not
    totals = accelerator.reduce(sums, "sum").tolist()  # all-reduce + CPU-GPU sync point, once per eval
    loss, right, count, *metrics = (sum(row[i] for row in totals) for i in range(3 + len(names)))
    record = {"eval_loss": loss / max(count, 1.0), "eval_accuracy": round(right / max(count, 1.0), 6)}
    record.update({f"eval_{name}": value / max(count, 1.0) for name, value in zip(names, metrics)})
    if len(groups) > 1:  # a mixture: each source's own eval too
        record["eval_loss_by_source"] = {name: row[0] / max(row[2], 1.0) for (name, _, _), row in zip(groups, totals)}
        record["eval_accuracy_by_source"] = {name: round(row[1] / max(row[2], 1.0), 6)
                                             for (name, _, _), row in zip(groups, totals)}
    return record


def _eval_batches(groups: list[tuple[str, int, int]], accelerator, settings: LoopSettings) -> list[tuple]:
    """This process's eval batches as (group, start, end): every num_processes-th batch of each source's eval
    examples, so a batch never mixes sources and the sums are reduced once at the end. Under `lockstep` (FSDP:
    every forward is collective) a process with fewer batches runs one of its batches again, uncounted (group
    None), until every process runs as many forwards."""
    size, processes, rank = settings.eval_micro_batch_size, accelerator.num_processes, accelerator.process_index
    mine, rounds = [], 0
    for number, (_, start, end) in enumerate(groups):
        firsts = range(start, end, size)
        rounds += -(-len(firsts) // processes)
        mine += [(number, first, min(first + size, end)) for first in firsts[rank::processes]]
    if settings.lockstep and groups:
        _, start, end = mine[0] if mine else (None, groups[0][1], min(groups[0][1] + size, groups[0][2]))
        mine += [(None, start, end)] * (rounds - len(mine))
    return mine


def _take_window(stream, state: TrainState, accelerator, data: DataBundle, settings: LoopSettings) -> list[dict]:
    """This process's micro-batches of one optimizer step. With several processes, each takes its own
    micro-batch from every group of `num_processes` consecutive ones: the data position stays one shared
    counter, identical on every process. A repeated window (settings.window_repeats) is taken again from where it
    started, and counts nothing again."""
    if state.step % settings.window_repeats:
        again = micro_batches(data, *state.window_start)
        return [data.collate(indices, settings.pad_id)
                for _ in range(settings.accumulation) for rank in range(accelerator.num_processes)
                for _, indices in [next(again)] if rank == accelerator.process_index]
    state.window_start = [state.epoch, state.batch_in_epoch]
    window = []
    for _ in range(settings.accumulation):
        for rank in range(accelerator.num_processes):
            (state.epoch, state.batch_in_epoch), indices = next(stream)
            if rank == accelerator.process_index:
                window.append(data.collate(indices, settings.pad_id))
            state.samples_seen += len(indices)
            if data.mixture is not None:  # what each source has given so far (the same on every process)
                for index in indices:
                    name = data.mixture.source_of(index)
                    state.examples_by_source[name] = state.examples_by_source.get(name, 0) + 1
    return window


def _forward_backward(model, window: list[dict], accelerator, settings: LoopSettings, scale: float) -> torch.Tensor:
    """Forward and backward of each micro-batch of the window (the gradients add up); the summed loss, then the
    sum of each of settings.metric_names. The loss function marks its forward and loss parts for the profiler."""
    sums = torch.zeros(1 + len(settings.metric_names), device=accelerator.device)
    for micro_step, batch in enumerate(window):
        with span("data"):
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        last = micro_step == len(window) - 1
        # Skip the gradient all-reduce on all but the last micro-batch of the window.
        sync = contextlib.nullcontext() if last else accelerator.no_sync(model)
        with sync:
            with accelerator.autocast():
                micro_loss, *metrics = _as_tuple(settings.loss_fn(model, batch))
            with span("backward"):
                accelerator.backward(micro_loss * scale)
        sums += torch.stack([micro_loss.detach(), *(metrics[0][name].detach() for name in settings.metric_names)])
    return sums


def _as_tuple(output) -> tuple:
    """A loss function's output as (loss,) or (loss, {metric: sum})."""
    return output if isinstance(output, tuple) else (output,)


def _optimizer_step(optimizer, accelerator, loss: float, grad_norm: float) -> tuple[bool, bool]:
    """Step unless the step went wrong. Returns (skipped, diverging)."""
    if accelerator.scaler is not None:
        # fp16: the GradScaler itself skips a step with inf/nan gradients and lowers its scale. Those
        # skips are normal while it calibrates; only a non-finite loss counts as going wrong.
        optimizer.step()
        return accelerator.optimizer_step_was_skipped, not math.isfinite(loss)
    diverging = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not diverging:
        optimizer.step()
    return diverging, diverging


def _count_skip(state: TrainState, record: dict, skipped: bool, diverging: bool) -> None:
    """A skipped step, counted and marked in its record: `nonfinite` when it went wrong (every skip but an fp16
    GradScaler's own while it finds its scale)."""
    state.skipped_steps += int(skipped)
    state.nonfinite_steps += int(diverging)
    if skipped:
        record["skipped"] = True
    if diverging:
        record["nonfinite"] = True


def eval_due(data: DataBundle, settings: LoopSettings, step: int) -> bool:
    """An eval every `eval_every` steps before the last (the last step is always evaluated after the loop)."""
    return data.eval is not None and bool(settings.eval_every) and step % settings.eval_every == 0 \
        and step < settings.total_steps


def train(model, optimizer, scheduler, accelerator, data: DataBundle, state: TrainState,
          settings: LoopSettings, hooks: Hooks) -> str:
    """Run optimizer steps until `settings.total_steps` or a hook says stop. Returns why it stopped."""
    device = accelerator.device
    params = [p for p in model.parameters() if p.requires_grad]
    stream = micro_batches(data, state.epoch, state.batch_in_epoch)
    batches_per_epoch = len(data.plan)
    model.train()
    last_step_s = 0.0
    skips_in_a_row = 0
    heap = heap_trimmer(torch.device(device).type)
    if 0 < state.step and state.evaluated_step < state.step and eval_due(data, settings, state.step):
        # A resumed run evaluates the step it starts from again when that step is an eval point whose eval the
        # checkpoint does not include: the process that wrote the checkpoint may have died before writing the eval
        # record (the run drops that record).
        hooks.on_eval({"step": state.step, **evaluate(model, accelerator, data, settings)}, state)
    while state.step < settings.total_steps:
        reason = hooks.should_stop(state, last_step_s)
        if reason:
            return reason
        started = time.perf_counter()

        with span("data"):
            # One optimizer step = `accumulation` micro-batches. Collate the whole window first: the loss is
            # normalized by the units (target tokens, or pairs) of the window summed over all processes, not per
            # micro-batch.
            window = _take_window(stream, state, accelerator, data, settings)
            # Target, token and unit counts of the whole window on all processes, in one all-reduce before the
            # forward: the loss scale needs the units. A blocking sync point (exact in float64 up to 2**53 tokens).
            counts = torch.tensor([float(sum(count_targets(b) for b in window)),
                                   float(sum(count_tokens(b) for b in window)),
                                   float(sum(settings.count_units(b) for b in window))],
                                  dtype=torch.float64, device=device)
            global_targets, step_tokens, units = (float(x) for x in accelerator.reduce(counts, "sum").tolist())
            step_tokens, units = int(step_tokens), max(units, 1.0)
        # DDP averages gradients over processes; multiplying by their number turns that into a sum.
        sums = _forward_backward(model, window, accelerator, settings, accelerator.num_processes / units)
        if heap is not None:
            heap.after_backward()  # the step's activations are freed: trim the C heap if it crept up (train.heap)

        with span("optimizer"):
            # clip_grad_norm_ unscales fp16 gradients first; with no limit it still returns the norm we log.
            grad_norm = accelerator.clip_grad_norm_(params, settings.max_grad_norm or math.inf)
            loss, *metrics = (x / units for x in accelerator.reduce(sums, "sum").tolist())  # all-reduce + sync point
            grad_norm = float(full_value(grad_norm))  # sync point; global (DDP all-reduced; FSDP: reduced DTensor)
            skipped, diverging = _optimizer_step(optimizer, accelerator, loss, grad_norm)
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            _schedule_step(scheduler)
        state.step += 1
        state.tokens_seen += step_tokens
        state.target_tokens_seen += int(global_targets)
        last_step_s = time.perf_counter() - started
        state.elapsed_s += last_step_s
        record = {
            "step": state.step,
            "epoch": round(state.epoch + state.batch_in_epoch / batches_per_epoch, 4),
            "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens": step_tokens, "target_tokens": int(global_targets),
            "tokens_per_s": round(step_tokens / max(last_step_s, 1e-9), 1),
            "peak_mem_mb": round(peak_memory_mb(device), 1),
            "step_s": round(last_step_s, 4), "elapsed_s": round(state.elapsed_s, 3),
        }
        record.update(zip(settings.metric_names, metrics))
        if state.examples_by_source:
            record["examples_by_source"] = dict(state.examples_by_source)
        _count_skip(state, record, skipped, diverging)
        skips_in_a_row = skips_in_a_row + 1 if diverging else 0
        hooks.on_step(record, state)
        if skips_in_a_row >= settings.max_consecutive_skips:
            raise TooManySkippedSteps(f"{skips_in_a_row} optimizer steps in a row had a non-finite loss or "
                                      f"gradient norm (last at step {state.step})")
        if eval_due(data, settings, state.step):
            hooks.on_eval({"step": state.step, **evaluate(model, accelerator, data, settings)}, state)
    if state.step and state.nonfinite_steps >= state.step:  # fewer steps than max_consecutive_skips, all bad
        raise TooManySkippedSteps(f"every one of the {state.step} optimizer steps had a non-finite loss or gradient "
                                  "norm, so the weights never changed")
    if data.eval is not None and state.evaluated_step < state.step:  # (a resumed checkpoint may include it)
        hooks.on_eval({"step": state.step, **evaluate(model, accelerator, data, settings)}, state)
    return "done"
