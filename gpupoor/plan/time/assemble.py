"""The time plan of a recipe, put together: the cached facts (gpupoor.plan.time.facts) measured where they are missing,
or a named GPU's published peak on paper, then gpupoor.plan.time.estimate's arithmetic. `gpupoor plan` calls this;
`validate` and training's preflight never do (they must not probe)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.plan.time import facts as cache
from gpupoor.plan.time.measure import attention_probe_shape, probe_rows
from gpupoor.plan.time.estimate import GPU_PEAKS, PAPER_PROBE_FRACTION, Rates, TimePlan, make_time_plan

FILE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Rates' fields, in order ("rate": the matmul; "decode": GRPO's, at as many rows as answers sampled at once)
PROBES = ("rate", "lora", "attention", "values", "optimizer", "call", "decode")


def plan_threads(recipe, requested: int | None) -> int:
    """The threads training would use on a CPU: --threads, training.cpu_threads, else the cores this process may
    run on (training also leaves out cores busy at its start; the plan assumes none are)."""
    if requested:
        return requested
    if recipe.training.cpu_threads:
        return recipe.training.cpu_threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


TIME_PLAN_MODES = {"measure": "measure what the facts cache lacks (the default)",
                   "cached": "use only the facts cache: no time plan where it lacks something"}


def time_plan_mode() -> str:
    """GPUPOOR_TIME_PLAN: whether `train` may measure what the time plan lacks (a bad value is the user's error)."""
    value = os.environ.get("GPUPOOR_TIME_PLAN", "").strip() or "measure"
    if value not in TIME_PLAN_MODES:
        raise UserError(f"environment variable GPUPOOR_TIME_PLAN={value!r}: not a time plan mode",
                        hint="; ".join(f"{k}: {v}" for k, v in TIME_PLAN_MODES.items()) + "; or unset it")
    return value


def probe_seconds() -> float | None:
    """GPUPOOR_PROBE_SECONDS: the seconds of steps the step probe times at its shallow depth (None: its default)."""
    value = os.environ.get("GPUPOOR_PROBE_SECONDS", "").strip()
    try:
        seconds = float(value) if value else None
    except ValueError:
        seconds = -1.0
    if seconds is not None and not 0 <= seconds <= 3600:
        raise UserError(f"environment variable GPUPOOR_PROBE_SECONDS={value!r}: not a number of seconds from 0 to "
                        "3600", hint="e.g. 2 (the default); 0 times the fewest steps; or unset it")
    return seconds


def check_environment() -> None:
    """The time plan's environment variables, checked before a command starts anything."""
    time_plan_mode()
    probe_seconds()


def gpu_on_paper(name: str) -> tuple[float, str]:
    key = name.upper().replace(" ", "").replace("-", "")
    if key not in GPU_PEAKS:
        raise UserError(f"--gpu {name}: not a GPU the time plan knows", hint=f"one of {', '.join(GPU_PEAKS)}")
    return GPU_PEAKS[key]


def time_plan(loaded, plan, shape, settings, *, processes: int, threads: int | None, gpu: str | None,
              time_limit_s: float | None, say, cached_only: bool = False,
              cli_s: float | None = None, stop=None) -> TimePlan | None:
    """The time plan; `say` tells the user when this plan measures (a first plan of this machine or data).
    `cached_only`: None rather than measure what the cache lacks. `cli_s`: the command's own start before the
    plan (a train's "python and cli"; a `plan` command's own age). Either way the plan keeps `time_keys` (the
    machine, the recipe's step key), where training records the step time it measured. `stop`: a callable that
    says training was asked to stop while the child measures (the child is killed)."""
    from gpupoor.storage.rundir import portable_recipe

    cli_s = _own_start() if cli_s is None else cli_s
    recipe = portable_recipe(loaded)  # paths absolute, as the run dir stores them: the child resolves the same files
    device = settings.device
    if gpu and device != "cuda":
        raise UserError("--gpu names a GPU to plan on paper: it needs --device cuda", hint="add --device cuda")
    on_paper = device == "cuda" and (gpu is not None or settings.gpu_major is None)
    if on_paper and gpu is None:  # the memory plan stands: the time plan says what it needs (not a user error)
        raise RuntimeError(f"no GPU here to measure: pass --gpu NAME ({', '.join(GPU_PEAKS)}) to plan it on paper")
    threads = plan_threads(recipe, threads) if device == "cpu" else None
    gpu_name = gpu if on_paper else _visible_gpu_name() if device == "cuda" else None
    machine = cache.machine_key(device, threads, gpu_name)
    facts = cache.read_facts()
    here = facts["machines"].setdefault(machine, {})
    data_key = cache.data_key(recipe, Path.cwd(), settings.sampler)
    tokens = recipe.data.max_length * recipe.training.micro_batch_size
    m = probe_rows(device, shape.hidden, shape.intermediate, tokens)
    step_key = cache.step_key(recipe, data_key, device, settings.precision)
    plan.time_keys = (machine, step_key)
    rates = here.setdefault("rates", {})
    data = facts["data"].get(data_key)
    keys = _rate_keys(settings, shape, m, data)
    request = {} if on_paper else _probes(keys, rates, settings, shape, device, threads, m, data)
    if data_key not in facts["data"]:
        request["data"] = {"recipe": recipe.model_dump(mode="json"), "sampler": settings.sampler}
    if "write_rate" not in here or "import_s" not in here:
        request["write_to"] = str(cache.facts_path().parent)
    probes, loads = here.setdefault("probes", {}), here.setdefault("loads", {})
    weights = None if on_paper else weight_files(recipe)
    load_key = _load_key(weights)
    if not on_paper:
        request.update(_step_request(recipe, settings, shape, threads, step_key in probes,
                                     weights if load_key not in loads else None))
    if request and cached_only:
        return None
    if request:
        say(f"time plan: measuring {_measuring(request)} (once; cached in {cache.facts_path()})")
        _keep(cache.measure(request, stop), facts, here, keys, settings, shape, data_key, step_key, load_key)
    batch = cache.batch_facts(facts["data"][data_key])
    if on_paper:
        peak, _ = gpu_on_paper(gpu)
        rate = Rates(peak * 1e12 * PAPER_PROBE_FRACTION)
    else:
        rate = Rates(*(rates.get(keys.get(kind)) for kind in PROBES))
    source = _source(rate, settings, shape, m, gpu if on_paper else None, threads, gpu_name)
    measured = here.get("steps", {}).get(step_key, {}).get("step_s") if not on_paper else None
    weight_bytes = shape.total_params * FILE_BYTES.get(shape.file_dtype or "fp32", 4)
    checkpoint_bytes = sum(t.bytes for t in plan.terms if t.key in ("trainable", "optimizer"))
    result = make_time_plan(shape, settings, recipe, batch, rates=rate, source=source, processes=processes,
                            import_s=here["import_s"], weight_file_bytes=weight_bytes,
                            checkpoint_bytes=checkpoint_bytes, write_rate=here["write_rate"], on_paper=on_paper,
                            measured_step_s=measured, time_limit_s=time_limit_s,
                            probe=None if on_paper else probes.get(step_key),
                            load=loads.get(load_key), cli_s=cli_s,
                            first_tokens=facts["data"][data_key].get("first_tokens"),
                            tokenizer_s=facts["data"][data_key].get("tokenizer_s"),
                            final_bytes=sum(t.bytes for t in plan.terms if t.key == "trainable"))
    if processes > 1 and not on_paper:
        result.assumed.append(f"the step measured in one process: {processes} processes add their gradients' "
                              "all-reduce")
    if recipe.training.eval_every_steps and (recipe.data.eval_path or recipe.data.eval_rows or recipe.data.datasets):
        result.notes.append("evaluation (training.eval_every_steps) is not counted: add its forward passes")
    if request:
        result.notes.append(f"measured now: {', '.join(request)} (cached for the next plan)")
    if measured:
        result.notes.append(f"the totals use the step time `train` measured for this recipe here ({measured:.3g} s)")
    return result


def _source(rate: Rates, settings, shape, m: int, paper_gpu: str | None, threads: int | None,
            gpu_name: str | None) -> str:
    """Where the time figures come from, in one line."""
    if paper_gpu:
        peak, source_of_peak = gpu_on_paper(paper_gpu)
        return (f"on paper: {paper_gpu}'s published peak {peak:g} TFLOP/s ({source_of_peak}) x "
                f"{PAPER_PROBE_FRACTION:g} (the share a training-shaped matmul reached on the H100 lent here) x "
                "per-term efficiencies fitted on that H100's runs (docs/benchmarks.md)")
    cpu = settings.device == "cpu"
    probed = f"matmuls {rate.matmul / 1e9:,.0f} GFLOP/s ({m}x{shape.hidden}x{shape.intermediate})"
    if cpu:
        probed += (f", LoRA's {rate.lora / 1e9:,.0f} GFLOP/s, attention {rate.attention / 1e9:,.0f} GFLOP/s, "
                   f"{rate.values / 1e9:.2f} G elementwise values/s, AdamW {rate.optimizer / 1e9:.2f} G "
                   f"parameters/s, {rate.call * 1e6:.0f} us a module call")
        if rate.decode:
            probed += f", GRPO's decode matmuls {rate.decode / 1e9:,.0f} GFLOP/s ({settings.sampled_answers} rows)"
    return (f"this machine's {settings.precision} {probed} ({f'{threads} threads' if cpu else gpu_name}; probed "
            f"once, cached) x per-term efficiencies fitted on measured {'CPU' if cpu else 'GPU'} runs "
            "(docs/benchmarks.md, Time plan accuracy)")


def _rate_keys(settings, shape, m: int, data: dict | None) -> dict:
    """Where each probed rate is cached: the matmul's by its shape, attention's by the data's example length (unknown
    until the data is counted), the elementwise rate by the batch, the call's per machine."""
    keys = {"rate": cache.rate_key(settings.precision, m, shape.hidden, shape.intermediate),
            "lora": f"lora {settings.precision} {m}x{shape.hidden}x{shape.intermediate} rank {settings.rank}",
            "values": f"values {settings.precision} {m}x{shape.hidden}x{shape.intermediate}",
            "optimizer": "adamw fp32", "call": "call"}
    if settings.sampled_answers:  # a plain matmul at the decode step's rows: the same cache entry as one
        keys["decode"] = cache.rate_key(settings.precision, settings.sampled_answers, shape.hidden, shape.intermediate)
    if data is not None:
        length, _ = attention_probe_shape(data, settings.attention_per_example)
        keys["attention"] = cache.attention_key(settings, shape, length)
    return keys


def _probes(keys: dict, rates: dict, settings, shape, device: str, threads: int | None, m: int,
            data: dict | None) -> dict:
    """What the child must measure of this machine's speed: what the cache lacks. On a GPU only the matmul (its
    coefficients are fitted against the matmul rate alone)."""
    request: dict = {}
    common = {"device": device, "precision": settings.precision, "threads": threads}
    if keys["rate"] not in rates:
        request["rate"] = {**common, "m": m, "k": shape.hidden, "n": shape.intermediate}
    if device == "cuda":
        return request
    if keys["lora"] not in rates:
        request["lora"] = {**common, "m": m, "k": shape.hidden, "n": shape.intermediate, "rank": settings.rank}
    if keys.get("attention") not in rates:
        request["attention"] = {**common, "heads": shape.heads, "kv_heads": shape.kv_heads,
                                "head_dim": shape.head_dim, "per_example": settings.attention_per_example,
                                "data": data}
    if keys["values"] not in rates:
        request["values"] = {**common, "m": m, "hidden": shape.hidden, "intermediate": shape.intermediate}
    if keys["optimizer"] not in rates:
        request["optimizer"] = {"threads": threads}
    if keys["call"] not in rates:
        request["call"] = {"threads": threads}
    if "decode" in keys and keys["decode"] not in rates:
        request["decode"] = {**common, "m": settings.sampled_answers, "k": shape.hidden, "n": shape.intermediate}
    return request


def _measuring(request: dict) -> str:
    """What the child is about to measure, in words."""
    return " and ".join(w for w, kinds in (("the data as training will see it", ("data",)),
                                           ("this machine's speed", PROBES),
                                           ("a few steps of the recipe at two depths of its model", ("steps",)),
                                           ("the weights' load", ("load",)),
                                           ("the disk's write rate", ("write_to",))) if request.keys() & set(kinds))


def _own_start() -> float | None:
    """This command's own start so far (Python, the command line, the recipe's checks, the memory plan), which a
    `train` spends too before its start-up clock's first mark; None in a process not started for one command."""
    from gpupoor.process import from_command_line, process_age_s

    return process_age_s() if from_command_line() else None


def _step_request(recipe, settings, shape, threads: int | None, have_steps: bool, weights: dict | None) -> dict:
    """What the child measures of the recipe itself: a few steps at two depths (gpupoor.run.step_probe) and the
    real weights' load, where the cache lacks them."""
    request: dict = {"load": weights} if weights is not None else {}
    if not have_steps:
        request["steps"] = {"recipe": recipe.model_dump(mode="json"), "device": settings.device,
                            "precision": settings.precision, "threads": threads, "layers": shape.layers,
                            "cycle": recipe.grpo.iterations if settings.sampled_answers else 1,
                            "last_layers": recipe.peft.last_layers, "seconds": probe_seconds()}
    return request


def _keep(answer: dict, facts: dict, here: dict, keys: dict, settings, shape, data_key: str, step_key: str,
          load_key: str | None) -> None:
    """The child's answer into the facts cache, and the cache written."""
    here["import_s"] = answer["import_s"]
    if "data" in answer:
        facts["data"][data_key] = answer["data"]
    if "attention" in answer:  # its key names the length the child took from the data
        keys["attention"] = cache.attention_key(settings, shape, answer["attention"]["length"])
        answer["attention"] = answer["attention"]["rate"]
    rates = here["rates"]
    for kind in PROBES:
        if kind in answer:
            rates[keys[kind]] = answer[kind]
    if "write_rate" in answer:
        here["write_rate"] = answer["write_rate"]
    if "steps" in answer:
        here["probes"][step_key] = answer["steps"]
    if "load" in answer:
        here["loads"][load_key] = answer["load"]
    cache.write_facts(facts)


def weight_files(recipe) -> dict | None:
    """What the child times of the real weights' load: a GGUF's parts, or a local directory's weight files read;
    None for a hub id (its files are wherever the hub's cache keeps them)."""
    from gpupoor.model.gguf import is_gguf, joined

    location = Path(joined(recipe.model.name_or_path, recipe.model.gguf_file)).expanduser()
    if is_gguf(str(location)) and location.is_file():
        return {"gguf": str(location)}
    if location.is_dir():
        files = sorted(str(p) for p in location.glob("*.safetensors")) or sorted(str(p) for p in location.glob("*.bin"))
        return {"read": files} if files else None
    return None


def _load_key(weights: dict | None) -> str | None:
    if weights is None:
        return None
    paths = weights.get("read") or [weights["gguf"]]
    return json.dumps([cache._file_state(path, Path("/")) for path in paths])


def _visible_gpu_name() -> str | None:
    from gpupoor.plan.device import _nvidia_smi

    answer = _nvidia_smi("name")
    return answer[0] if answer else None
