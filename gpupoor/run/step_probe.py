"""The time plan's measurement of a step on this machine (issue #57): the recipe itself trained for a few steps by
training's own code, its model cut to a few of its layers with random weights (gpupoor.model.load.probe_depth),
at two depths. Everything a step does (the method, the objective, GRPO's sampling at its group size, the
attention at the data's own batches, the optimizer, the casts of the precision) is in the measured times;
the difference between the depths is one layer's cost, and the step of the whole model is extrapolated from it
(gpupoor.plan.time.probed). Also measured: what loading the real weights costs, by its parts (gguf_load_facts,
read_rate). Runs in the time plan's child process (gpupoor.run.measuring): it imports torch and trains."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Steps each depth trains: the first warms up; then timed ones, TIMED_STEPS, or as many as take about
# TIMED_SECONDS at the shallow depth (a tiny model's steps are milliseconds: a few of them are all noise), at
# most MAX_TIMED_STEPS; whole sampling cycles, at least two (GRPO).
TIMED_STEPS = 4
TIMED_SECONDS = 2.0
MAX_TIMED_STEPS = 40
READ_PROBE_BYTES = 256 * 2**20
DEQUANTIZE_SAMPLE_BYTES = 32 * 2**20


def probe_depths(layers: int, last_layers: int | None) -> tuple[int, int]:
    """The two depths trained: 1 layer and a quarter of them (at least 3: the gap between the depths is what a
    layer costs, and over a few layers a step's noise is a large share of it); with peft.last_layers N, the N
    trained layers and then frozen ones below them (the depth adds frozen layers, which cost less)."""
    low = min(last_layers, layers) if last_layers else 1
    return low, min(layers, max(low + 2, round(layers / 4)))


def timed_steps(shallow_step_s: float | None, cycle: int, seconds: float | None = None) -> int:
    """Steps to time at each depth: TIMED_STEPS, more where a step is short (`seconds` of them at the shallow
    depth: the request's, from GPUPOOR_PROBE_SECONDS, else TIMED_SECONDS); whole cycles, at least two."""
    if seconds is None:
        seconds = TIMED_SECONDS
    wanted = TIMED_STEPS if not shallow_step_s else min(MAX_TIMED_STEPS, max(
        TIMED_STEPS, math.ceil(seconds / shallow_step_s)))
    return max(2, math.ceil(wanted / cycle)) * cycle


def probe_recipe(recipe_json: dict, *, device: str, precision: str, threads: int | None, cycle: int,
                 timed: int | None = None) -> dict:
    """The recipe as the probe trains it: a few steps, one micro-batch a step, nothing evaluated, saved or
    tracked beyond what every run does, on the plan's device, precision and threads."""
    recipe = json.loads(json.dumps(recipe_json))
    training = recipe["training"]
    training.update({"max_steps": 1 + (timed or timed_steps(None, cycle)), "epochs": None,
                     "gradient_accumulation_steps": 1, "eval_every_steps": None, "device": device})
    if device == "cpu":
        training["cpu_threads"] = threads
    recipe["precision"] = precision
    recipe["checkpoint"].update({"every_steps": None, "every_minutes": None, "time_limit": None})
    recipe["logging"].update({"progress": "none", "report_to": [], "report": False, "every_steps": 1,
                              "profile_steps": None})
    recipe["peft"]["init_adapter"] = None
    recipe.pop("output_dir", None)
    return recipe


def run_depth(recipe_json: dict, layers: int, of: int, folder: Path) -> dict:
    """One depth trained in this process: its step times and tokens, and where its start-up went."""
    from gpupoor.model.load import probe_depth
    from gpupoor.recipe.loading import LoadedRecipe
    from gpupoor.recipe.schema import Recipe
    from gpupoor.run.orchestrate import train_from_recipe

    recipe = Recipe.model_validate(recipe_json)
    run_dir = folder / f"depth-{layers}"
    quiet = lambda *args, **kwargs: None  # noqa: E731 -- the plan's child answers on stdout: nothing else there
    with probe_depth(layers, of), contextlib.redirect_stdout(sys.stderr):
        train_from_recipe(LoadedRecipe(recipe, None), str(run_dir), say=quiet)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next(r for r in records if r.get("event") == "start")
    steps = [r for r in records if "step_s" in r and "loss" in r]
    saves = [r["save_s"] for r in records if "checkpoint" in r and "save_s" in r]
    return {"layers": layers, "step_s": [r["step_s"] for r in steps], "tokens": [r.get("tokens") for r in steps],
            "startup": start.get("startup_s", {}), "save_s": saves[-1] if saves else None}


def probe_steps(request: dict) -> dict:
    """Both depths of the recipe trained; the raw times for gpupoor.plan.time.probed to extrapolate."""
    os.environ["GPUPOOR_STEP_PROBE"] = "1"  # the nested runs make no time plan of their own (no probe in a probe)
    cycle, layers = request["cycle"], request["layers"]
    options = {"device": request["device"], "precision": request["precision"], "threads": request.get("threads"),
               "cycle": cycle}
    recipe = probe_recipe(request["recipe"], **options)
    started = time.perf_counter()
    _read_config_once(recipe)
    shallow, deep = probe_depths(layers, request.get("last_layers"))
    with tempfile.TemporaryDirectory(prefix="gpupoor-step-probe-") as folder:
        first = run_depth(recipe, shallow, layers, Path(folder) / "first")
        timed = timed_steps(statistics.median(first["step_s"][1:]), cycle, request.get("seconds"))
        if timed > len(first["step_s"]) - 1:  # short steps: time more of them, at both depths
            recipe = probe_recipe(request["recipe"], **options, timed=timed)
            first = run_depth(recipe, shallow, layers, Path(folder) / "again")
        depths = [first, run_depth(recipe, deep, layers, Path(folder))]
    return {"layers": layers, "cycle": request["cycle"], "depths": depths,
            "probe_s": round(time.perf_counter() - started, 3)}


def _read_config_once(recipe_json: dict) -> None:
    """The model's config read before the depths train, so that each depth's "model" start-up part is the model
    built alone (a GGUF's config takes seconds to read; gpupoor.model.load remembers it in this process)."""
    from gpupoor.model.load import load_config, model_location
    from gpupoor.recipe.schema import Recipe

    model = Recipe.model_validate(recipe_json).model
    load_config(model_location(model, Path.cwd()), model)


def read_rate(paths: list[str]) -> float | None:
    """Bytes a second this machine reads the model's weight files at (up to READ_PROBE_BYTES of them)."""
    block, done = 8 * 2**20, 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb") as handle:
            while done < READ_PROBE_BYTES and (chunk := handle.read(block)):
                done += len(chunk)
    seconds = time.perf_counter() - started
    return done / seconds if done and seconds > 0 else None


def gguf_load_facts(path: str) -> dict:
    """What loading a GGUF costs here, by part: transformers reads the file's metadata (three times: gpupoor's
    check, the config, the weights), maps each of its tensors' names (a gguf name map built per module) and
    dequantizes every tensor."""
    import gguf

    from gpupoor.model.gguf import reader_of

    reader, reader_s = reader_of(Path(path))  # read already by the data's count (the tokenizer's check): its time
    sample, sampled_bytes = [], 0
    for tensor in sorted(reader.tensors, key=lambda t: -int(t.n_bytes)):
        if sampled_bytes >= DEQUANTIZE_SAMPLE_BYTES:
            break
        sample.append(tensor)
        sampled_bytes += int(tensor.n_bytes)
    started = time.perf_counter()
    for tensor in sample:
        gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    dequantize_s = time.perf_counter() - started
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    blocks = next((int(f.parts[-1][0]) for name, f in reader.fields.items() if name.endswith(".block_count")), 1)
    started = time.perf_counter()
    try:
        gguf.get_tensor_name_map(_arch(gguf, architecture), blocks)
        name_map_s = time.perf_counter() - started
    except Exception:  # noqa: BLE001 -- an architecture gguf cannot map: its cost is not counted
        name_map_s = 0.0
    return {"reader_s": round(reader_s, 4), "dequantize_s_per_byte": dequantize_s / max(sampled_bytes, 1),
            "tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors), "name_map_s": name_map_s,
            "tensors": len(reader.tensors)}


def _arch(gguf, name: str):
    return next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == name)
