"""The measured facts behind the time plan, cached per machine in $GPUPOOR_CACHE/time-facts.json: this machine's
matmul rate at a run's precision and shapes, its disk's write rate, how long training's imports take, the data
as the loop collates it, and the step times `train` measured. The first `gpupoor plan` of a machine (or of new
data) measures them in a child process (gpupoor.plan.time.measure) and says so; later ones read the cache and import
no torch. Everything read back is checked: a damaged file is measured again, never trusted.

A machine is its CPU model and the threads training uses, or its GPU's name, with the torch version: the
rates change with any of them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from gpupoor import faults
from gpupoor.objective_table import objective_of
from gpupoor.plan.time.work import BatchFacts
from gpupoor.storage.files import atomic_file, default_cache_dir

FACTS_FILE = "time-facts.json"
FACTS_VERSION = 1
WRITE_PROBE_BYTES = 32 * 2**20
MEASURE_TIMEOUT_S = 3600  # tokenizing a big dataset for the first time can take long; a hung child must not hang us


def facts_path() -> Path:
    return default_cache_dir() / FACTS_FILE


def read_facts() -> dict:
    """The cache, or an empty one where it is missing or does not check out."""
    try:
        facts = json.loads(facts_path().read_text())
    except (OSError, ValueError):
        return {"version": FACTS_VERSION, "machines": {}, "data": {}}
    if not (isinstance(facts, dict) and facts.get("version") == FACTS_VERSION
            and isinstance(facts.get("machines"), dict) and isinstance(facts.get("data"), dict)):
        return {"version": FACTS_VERSION, "machines": {}, "data": {}}
    return facts


def write_facts(facts: dict) -> None:
    """Atomically: a plan and a training run may write at once; the later whole file wins, never a torn one."""
    try:
        with atomic_file(facts_path()) as temporary:
            temporary.write_text(json.dumps(facts, indent=1, sort_keys=True))
    except OSError:
        pass  # an unwritable cache costs a probe next time, never the plan


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine_key(device: str, threads: int | None, gpu_name: str | None = None) -> str:
    where = (gpu_name or "cuda") if device == "cuda" else f"{cpu_model()}, {threads} threads"
    return f"{where}; torch {torch_version()}"


def _file_state(path: str, base: Path) -> list:
    candidate = Path(path) if Path(path).is_absolute() else base / path
    try:
        info = candidate.stat()
    except OSError:
        return [path]  # a hub dataset or a missing file: its name alone (the data section's own errors come later)
    if candidate.is_dir():
        return [path, sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in candidate.rglob("*")
                             if p.is_file())]
    return [path, info.st_size, info.st_mtime_ns]


def data_key(recipe, base: Path, sampler: str) -> str:
    """What the data facts depend on: the data section, the files' sizes and times, the tokenizer's model, the
    batch, the seed and the sampler."""
    data = recipe.data
    paths = [p for p in [data.path, data.eval_path, data.tokenized_path] if p]
    paths += [p for source in data.datasets or [] for p in (source.path, source.eval_path) if p]
    key = {"data": data.model_dump(mode="json"), "files": [_file_state(p, base) for p in paths],
           "model": recipe.model.name_or_path, "gguf": recipe.model.gguf_file, "revision": recipe.model.revision,
           "micro_batch": recipe.training.micro_batch_size, "seed": recipe.seed, "sampler": sampler}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def step_key(recipe, data: str, device: str, precision: str) -> str:
    """What a step's time depends on besides the machine: the model, method, memory settings, batch and data."""
    training = recipe.training
    key = {"model": recipe.model.model_dump(mode="json"), "peft": recipe.peft.model_dump(mode="json"),
           "quantization": recipe.quantization.model_dump(mode="json"),
           "memory": recipe.memory.model_dump(mode="json"), "precision": precision, "device": device,
           "distill": recipe.distill.model_dump(mode="json") if recipe.distill else None,
           "preference": recipe.preference.model_dump(mode="json"), "objective": training.objective,
           "batch": [training.micro_batch_size, training.gradient_accumulation_steps, training.optimizer],
           "data": data, "grpo": recipe.grpo.model_dump(mode="json") if objective_of(recipe).samples else None}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def rate_key(precision: str, m: int, k: int, n: int) -> str:
    return f"{precision} {m}x{k}x{n}"


def attention_key(settings, shape, length: int) -> str:
    how = "per example" if settings.attention_per_example else "causal rows"
    return f"attention {settings.precision} {how} {length} tokens {shape.heads}/{shape.kv_heads}x{shape.head_dim}"


def measure(request: dict, stop=None) -> dict:
    """Run gpupoor.run.measuring in a child process (torch stays out of this one) and return its answer. `stop`:
    a callable that says a stop was asked for (a SIGTERM to `train`): the child is killed then, not waited for."""
    with tempfile.TemporaryDirectory(prefix="gpupoor-measure-") as folder:
        path = Path(folder) / "request.json"
        path.write_text(json.dumps(request))
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        with out.open("w") as stdout, err.open("w") as stderr:
            # the child trains the probe: a fault a test injects into this process's run is not its own
            env = {k: v for k, v in os.environ.items() if k != "GPUPOOR_FAULT"} | {"PYTHONWARNINGS": "ignore"}
            child = subprocess.Popen([sys.executable, "-m", "gpupoor.run.measuring", str(path)], stdout=stdout,
                                     stderr=stderr, text=True, env=env)
            faults.at_stage("measuring")  # tests: a signal while the child measures
            _wait(child, stop)
        lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
        if child.returncode != 0 or not lines:
            tail = (err.read_text() or out.read_text()).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"measuring for the time plan failed: {tail[0]}")
    return json.loads(lines[-1])


def _wait(child: subprocess.Popen, stop) -> None:
    """Wait for the child up to MEASURE_TIMEOUT_S; kill it (and wait for it to go) on a stop or the timeout."""
    deadline = time.monotonic() + MEASURE_TIMEOUT_S
    try:
        while True:
            try:
                child.wait(timeout=0.2)
                return
            except subprocess.TimeoutExpired:
                if stop is not None and stop():
                    raise RuntimeError("measuring for the time plan stopped: a stop was asked for") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"measuring for the time plan took over {MEASURE_TIMEOUT_S} s") from None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def write_rate(folder: Path) -> float:
    """Bytes per second this disk takes a checkpoint-sized write at, fsync included (32 MiB)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(2**20)
    fd, name = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
    try:
        start = time.perf_counter()
        with os.fdopen(fd, "wb") as handle:
            for _ in range(WRITE_PROBE_BYTES // len(block)):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        return WRITE_PROBE_BYTES / max(time.perf_counter() - start, 1e-6)
    finally:
        os.unlink(name)


def batch_facts(entry: dict) -> BatchFacts:
    return BatchFacts(int(entry["micro_batches"]), *(float(entry[k]) for k in
                                                      ("tokens", "real_tokens", "targets", "example_pairs",
                                                       "row_pairs")))


def record_step_time(machine: str, key: str, step_s: float, predicted_s: float | None,
                     import_s: float | None = None) -> None:
    """What a `train` measured, for the next plan of the same recipe on the same machine: its step time, and how
    long its imports took (the plan's start-up: the child that first measured it imported cold, and more)."""
    facts = read_facts()
    entry = facts["machines"].setdefault(machine, {})
    entry.setdefault("steps", {})[key] = {"step_s": step_s, "predicted_s": predicted_s, "at": round(time.time())}
    if import_s:
        entry["import_s"] = round(import_s, 3)
    write_facts(facts)
