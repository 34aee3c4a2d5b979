"""`gpupoor plan`: the memory a recipe needs at its peak, term by term, from the model's config alone; and the
preflight that runs it before training loads anything.

No weights are loaded and torch is not imported: every term is arithmetic over the config's dimensions and the
recipe (gpupoor.plan.terms). A distillation teacher adds its weights and its share of the loss's working set.
"""

from __future__ import annotations

import os

from gpupoor.decisions import MIN_BF16_SPEEDUP, launch_layout
from gpupoor.errors import UserError
from gpupoor.objective_table import ROWS, objective_of
from gpupoor.plan.advice import apply_changes, compare_strategies, suggest
from gpupoor.plan.device import default_device, device_memory, gpu_facts
from gpupoor.plan.distributed import offloaded_terms
from gpupoor.plan.peak import peak_bytes, plan_terms, uses_bitsandbytes
from gpupoor.plan.render import describe_method, describe_preference, render_suggestions
from gpupoor.plan.result import Plan
from gpupoor.plan.settings import resolve_settings
from gpupoor.model.shape import load_shape, load_teacher_shape
from gpupoor.plan.terms import trainable_params
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.units import format_bytes


def make_plan(loaded: LoadedRecipe, device: str | None = None, *, memory: int | None = None, processes: int = 1,
              nodes: int = 1, timing: dict | None = None) -> Plan:
    """The plan of one process out of `processes` (on `nodes`), each `auto` decided as training decides it (on a
    CPU, the precision on its flags alone: training's probe may still choose fp32, and plans again if it does).
    `timing`: gpupoor.plan.time.assemble.time_plan's options, to add the time plan (which may measure: plan only)."""
    recipe = loaded.recipe
    device = device or default_device(recipe)
    gpu = gpu_facts(device)
    shape, source = load_shape(loaded)
    teacher, teacher_source = load_teacher_shape(loaded)
    settings = resolve_settings(recipe, device, shape, gpu, teacher=teacher, processes=processes)
    terms, assumptions = plan_terms(shape, settings, uses_bitsandbytes(recipe))
    if memory is not None:
        memory_source = "--memory"
    else:
        memory, memory_source = device_memory(device)
    assumptions.insert(0, f"model config: {source}")
    if teacher_source:
        assumptions.insert(1, f"teacher config: {teacher_source}")
    if recipe.precision == "auto" and device == "cuda" and gpu.major is None:
        assumptions.append("precision auto taken as bf16 (a GPU without bf16 uses fp16: the same bytes)")
    if recipe.precision == "auto" and device == "cpu" and settings.precision == "bf16":
        assumptions.append("precision auto taken as bf16 on the CPU's flags (training confirms with a matmul "
                           "probe, and trains in fp32 where bf16 measures under "
                           f"{MIN_BF16_SPEEDUP:g}x fp32: set precision to be sure)")
    # Processes on one machine share its RAM; on GPUs each has its own device.
    share = -(-processes // nodes) if device == "cpu" else 1
    if share > 1:
        assumptions.append(f"the {share} processes on a node share its RAM: they must fit together")
    plan = Plan(device, settings.precision, terms, memory, memory_source, assumptions, method=recipe.peft.method,
                trainable_params=trainable_params(shape, settings), method_detail=describe_method(shape, settings),
                processes=processes, nodes=nodes, strategy=settings.distribution.strategy, share=share,
                offloaded=offloaded_terms(shape, settings))
    if processes > 1:
        budget = None if memory is None else memory // share
        plan.strategies = compare_strategies(shape, recipe, device=device, gpu=gpu, teacher=teacher,
                                             processes=processes, budget=budget)
    if recipe.distill is not None:
        distill = recipe.distill
        plan.method_detail += (f"; distilled from {distill.teacher} (temperature {distill.temperature:g}, KL weight "
                               f"{distill.weight:g}" + (f", {distill.bits}-bit" if distill.bits else "") + ")")
    if objective_of(recipe).data != ROWS:
        plan.method_detail += "; " + describe_preference(recipe, settings)
    if timing is not None:
        _add_time_plan(plan, loaded, shape, settings, processes, timing)
    if plan.fits is False:
        plan.suggestions, plan.fit_changes = suggest(shape, recipe, device=device, memory=memory // share, gpu=gpu,
                                                     teacher=teacher, processes=processes)
        if plan.fit_changes:
            plan.fit_peak = peak_bytes(shape, apply_changes(recipe, plan.fit_changes), device, gpu, teacher=teacher,
                                       processes=processes)
    return plan


def _add_time_plan(plan: Plan, loaded: LoadedRecipe, shape, settings, processes: int, timing: dict) -> None:
    """The time plan, or why there is none: the memory plan stands either way."""
    from gpupoor.plan.time.assemble import time_plan

    if objective_of(loaded.recipe).samples and settings.device == "cuda":
        # its decode steps' efficiency is fitted on CPU runs only: no GPU run has calibrated it
        plan.time_error = ("GRPO's sampling is not calibrated on a GPU yet; train a few steps and read step_s in "
                           "metrics.jsonl")
        return
    try:
        plan.time = time_plan(loaded, plan, shape, settings, processes=processes, **timing)
    except UserError:
        raise  # a bad --gpu or --time-limit is the user's to fix
    except Exception as exc:  # noqa: BLE001 -- the data or a probe failing must not take the memory plan down
        plan.time_error = str(exc) or type(exc).__name__


def _launched() -> dict:
    """make_plan's settings for a run this launcher started: one of its processes."""
    processes, nodes = launch_layout(os.environ)
    return {"processes": processes, "nodes": nodes}


def preflight_plan(loaded: LoadedRecipe, force: bool, warn) -> Plan | None:
    """The plan before anything is loaded. On CUDA a recipe predicted not to fit stops here (exit 2) unless
    `force`; elsewhere a predicted miss is a warning. A model the plan cannot describe is a warning too."""
    try:
        plan = make_plan(loaded, **_launched())
    except Exception as exc:  # the plan advises; a model it cannot describe must not stop the run
        warn(f"no memory plan: {exc}")
        return None
    if plan.fits is False:
        message = (f"predicted peak memory {format_bytes(plan.peak)} does not fit {format_bytes(plan.memory)} "
                   f"({plan.memory_source}) on {plan.device}")
        advice = render_suggestions(plan)
        if plan.device == "cuda" and not force:
            raise UserError(message + (f"\n{advice}" if advice else ""),
                            hint="apply a change (gpupoor plan RECIPE --fit writes them), or pass --force to try anyway")
        warn(message + (" (--force: trying anyway)" if force else "") + (f"\n{advice}" if advice else ""))
    return plan
