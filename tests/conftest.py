"""Fixtures: a tokenizer trained here, tiny random-weight Llamas saved with save_pretrained, data files,
and a helper that writes recipes. Nothing is downloaded: HF_HUB_OFFLINE makes an accidental download fail.

The tests are in tiers, one directory each, and every test is marked with its directory's name:
  unit/         no training run, no subprocess: `make test`, after every change (under 2 minutes, xdist workers)
  integration/  in-process CLI runs and training
  system/       subprocesses, torchrun, SIGKILL and signals, learning quality
  gpu/          needs a CUDA GPU (skipped elsewhere)
  real/         pretrained models: the real model `make fetch-real` puts in the cache (fixtures `real_gguf`, and
                `real_model_dir`: it dequantized into a transformers directory)
`make test-all` runs every tier (what CI runs), two tests at a time: a test that cannot share the machine with
another (it measures wall-clock time, or a peak while nothing else runs) is marked `serial` and runs alone, last;
stops, kills and time limits are injected at a step (GPUPOOR_FAULT), so they need no such mark.
A test that trains or starts a process is not a unit test.
The tiers' fixtures are all here: a second conftest.py in a tier's directory would replace this module as
`conftest` in sys.modules, and the `from conftest import ...` of every test file collected after it would fail."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# `train` measures what the time plan's cache lacks (a child process training two depths of the model): a
# test's run uses the cache alone, unless the test is about that measurement (it deletes this).
os.environ["GPUPOOR_TIME_PLAN"] = "cached"
os.environ["GPUPOOR_PROBE_SECONDS"] = "0"  # the step probe times its fewest steps: the tiny models step in ms
# `precision: auto` decides the same on every CPU: fp32, as on one without bf16 matrix units (a CI machine may
# have AMX). Tests of the CPU bf16 choice pin other answers (gpupoor.cpu.PIN_VARIABLE) or unset it.
os.environ["GPUPOOR_CPU_BF16"] = "none"
if "PYTEST_XDIST_WORKER" in os.environ:  # several workers on a few cores: one thread each, or they fight
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

TIERS = ("unit", "integration", "system", "gpu", "real")

# Where `make fetch-real` put the real model, read before `_isolated_cache` points each test at its own cache.
from gpupoor.model.pretrained import SMOLLM2, is_verified, real_model_path  # noqa: E402 (after the env)

REAL_GGUF = real_model_path()

WORDS = ("the model learns to stop when the answer is done and every token counts toward the loss "
         "python lists sort reverse add numbers quickly small large data memory speed resume").split()


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def alpaca_rows(count: int, seed: int = 0) -> list[dict]:
    """Variable-length rows: prompts and answers of different sizes, some with an input."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        row = {"instruction": _sentence(rng, 2, 12), "output": _sentence(rng, 1, 20)}
        if index % 3 == 0:
            row["input"] = _sentence(rng, 1, 8)
        rows.append(row)
    return rows


def shipped_recipes(real: bool = False) -> list[Path]:
    """recipes/*.yaml: those that train a tiny or built-in model, or (real=True) those that train the real model,
    a .gguf in the cache that only the `real` tier may count on (`make fetch-real`)."""
    paths = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    return [path for path in paths
            if str(yaml.safe_load(path.read_text())["model"]["name_or_path"]).endswith(".gguf") == real]


class _Saved:
    """What the saved-tensors hook packs: alive exactly as long as autograd keeps the tensor for backward."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def saved_tensor_bytes(model, forward: Callable) -> int:
    """Bytes of what autograd keeps for backward at the end of `forward()`: unique storages, `model`'s parameters
    excluded, only tensors still held then (DoRA's B@A builds a graph it frees within the forward)."""
    import weakref

    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []

    def keep(tensor):
        box = _Saved(tensor)
        packed.append((weakref.ref(box), tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return box

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda box: box.tensor):
        out = forward()
    held = {ptr: size for ref, ptr, size in packed if ref() is not None and ptr not in params}
    del out
    return sum(held.values())


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def _no_time_plan_unless_asked(request, monkeypatch):
    """The time plan's first measurement imports torch and tokenizes in a child process (seconds): in-process plans
    skip it, and say so in the plan's `time_error`, unless the test asks for it (`@pytest.mark.time_plan`)."""
    if request.node.get_closest_marker("time_plan") is None:
        def skipped(*args, **kwargs):
            raise RuntimeError("skipped in tests not marked time_plan")

        monkeypatch.setattr("gpupoor.plan.time.assemble.time_plan", skipped)


@pytest.fixture(autouse=True)
def _no_report_at_the_end(request, monkeypatch):
    """A finished run draws report.html (~2 s of matplotlib): in-process runs of the tests skip it, except where a
    test asks for it (`@pytest.mark.report_at_the_end`)."""
    if request.node.get_closest_marker("report_at_the_end") is None:
        monkeypatch.setattr("gpupoor.commands.train.report_finished", lambda result, say=print: result.reason)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUPOOR_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory):
    """`once(settings, make) -> folder`: the folder that `make(folder)` writes, made once per test session however
    many xdist workers ask for it (a session fixture alone is once per worker): the first makes it under a file
    lock while the others wait, then all read the same folder. For the reference runs several tests compare with,
    and what they train from. `settings` (JSON) says everything the folder depends on: the same settings, the same
    folder. A make that fails leaves no mark, so the next test to ask makes it again (and fails the same way)."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:  # each worker's own basetemp is a folder of the session's
        root = root.parent
    root = root / "once-per-session"
    root.mkdir(exist_ok=True)

    def once(settings, make: Callable[[Path], None]) -> Path:
        text = json.dumps(settings, sort_keys=True)
        folder = root / hashlib.sha256(text.encode()).hexdigest()[:16]
        done = folder.with_suffix(".done")
        with open(folder.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                make(folder)
                done.write_text(text)
        return folder

    return once


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The real model's GGUF file (SmolLM2-135M-Instruct, Q4_1), checked against its pinned sha256."""
    if not is_verified(REAL_GGUF, SMOLLM2):
        pytest.fail(f"the real model is not in the cache ({REAL_GGUF} is missing or not the pinned file): run "
                    "`make fetch-real` first (`make test-all` does)", pytrace=False)
    return REAL_GGUF


@pytest.fixture(scope="session")
def real_model_dir(real_gguf) -> Path:
    """The real model dequantized once into a transformers directory beside its GGUF (fp32 safetensors and its
    tokenizer, verified on every read): a test that trains the real model loads it in a second or two, where the
    GGUF path spends half a minute dequantizing. The GGUF path itself is tested in tests/real/test_gguf_real.py."""
    from gpupoor.model.pretrained import dequantized_copy

    return dequantized_copy(real_gguf)


@pytest.fixture(scope="session")
def tokenizer():
    from gpupoor.data.row_formats import alpaca_prompt
    from gpupoor.model.tiny import train_tokenizer

    rng = random.Random(1)
    texts = [alpaca_prompt(_sentence(rng, 2, 9), _sentence(rng, 0, 5)) + _sentence(rng, 1, 9) for _ in range(300)]
    texts += ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"] * 20
    return train_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer) -> Path:
    from gpupoor.model.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", tokenizer, hidden=32, layers=2,
                            heads=4, kv_heads=2, seed=0)


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory, tokenizer) -> Path:
    from gpupoor.model.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tied", tokenizer, hidden=32, layers=2,
                            heads=4, kv_heads=2, seed=1, tie_embeddings=True)


@pytest.fixture(scope="session")
def sentencepiece_style_tokenizers():
    """space_prefix -> a SentencePiece-style tokenizer (Llama 2's layout with, Gemma's without, a leading ▁)."""
    import random

    from gpupoor.data.row_formats import alpaca_prompt
    from gpupoor.model.tiny import train_sentencepiece_style_tokenizer

    rng = random.Random(1)
    texts = [alpaca_prompt(_sentence(rng, 2, 9), _sentence(rng, 0, 5)) + _sentence(rng, 1, 9) for _ in range(300)]
    return {prefix: train_sentencepiece_style_tokenizer(texts, vocab_size=500, space_prefix=prefix)
            for prefix in (True, False)}


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_model) -> Path:
    """The tiny Llama written as one GGUF file (F32 tensors, its tokenizer and a chat template in the metadata)."""
    from gpupoor.model.tiny import write_tiny_gguf

    return write_tiny_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture()
def alpaca_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", alpaca_rows(48))


def write_recipe(path: Path, model_dir: Path, data_file: Path, **sections) -> Path:
    """A recipe for `model_dir` on `data_file`; keyword sections are merged over sensible test defaults."""
    recipe = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"path": str(data_file), "format": "alpaca", "max_length": 128, "sampler": "random"},
        "peft": {"rank": 4},
        "training": {"micro_batch_size": 4, "max_steps": 4, "learning_rate": 1e-2, "cpu_threads": 1,
                     "warmup_steps": 0},
        "logging": {"progress": "none", "report": False},  # report.html costs ~2 s of matplotlib a run
        "seed": 0,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture()
def make_recipe(tmp_path, tiny_model, alpaca_file):
    """Write a recipe for the tiny model; keyword sections are merged over sensible test defaults."""

    def make(name: str = "recipe.yaml", **sections) -> Path:
        return write_recipe(tmp_path / name, tiny_model, alpaca_file, **sections)

    return make


def reference_runs(tmp_path_factory, tiny_model):
    """`train(fault=None, **sections) -> run`: an uninterrupted run of the test recipe (on the same 48 rows
    as `alpaca_file`), trained once per module and recipe, for the module's tests to compare with or copy. A
    module fixture runs before the tests' own environment exists, so it sets its own cache and fault."""
    root = tmp_path_factory.mktemp("reference")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(48))
    runs: dict[tuple, Path] = {}

    def train(fault: str | None = None, **sections) -> Path:
        key = (fault, repr(sections))
        if key not in runs:
            run = root / f"run-{len(runs)}"
            recipe = write_recipe(root / f"recipe-{len(runs)}.yaml", tiny_model, data, **sections)
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setenv("GPUPOOR_CACHE", str(root / "cache"))
                result = invoke("train", recipe, "--output-dir", run, fault=fault, monkeypatch=monkeypatch)
            assert result.exit_code == 0, result.output
            runs[key] = run
        return runs[key]

    return train


# Every training method, and the last-N-layers variants (#14): recipe `peft` sections by name.
PEFT_METHODS = {
    "lora": {"method": "lora"},
    "dora": {"method": "dora"},
    "ia3": {"method": "ia3"},
    "full": {"method": "full"},
    "full-last-layer-and-head": {"method": "full", "last_layers": 1, "modules_to_save": ["lm_head"]},
    "lora-last-layer": {"method": "lora", "last_layers": 1},
    "dora-last-layer-and-head": {"method": "dora", "last_layers": 1, "modules_to_save": ["lm_head"]},
    "ia3-last-layer": {"method": "ia3", "last_layers": 1},
    "full-mlps-and-final-norm": {"method": "full", "modules_to_save": ["mlp", "norm"]},
}


def invoke(*args, monkeypatch=None, fault: str | None = None):
    """`gpupoor ARGS` in this process (typer's CliRunner), with GPUPOOR_FAULT set to `fault` (or cleared) when a
    monkeypatch is given."""
    from typer.testing import CliRunner

    from gpupoor.cli import app

    if monkeypatch is not None:
        if fault:
            monkeypatch.setenv("GPUPOOR_FAULT", fault)
        else:
            monkeypatch.delenv("GPUPOOR_FAULT", raising=False)
    return CliRunner().invoke(app, [str(a) for a in args])


def masked_batch(tokenizer) -> dict:
    """A padded batch with a prompt, padding and a hole among the targets: what a loss must skip."""
    import torch

    from gpupoor.data.assembly import IGNORE_INDEX

    ids = torch.randint(5, len(tokenizer), (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # a prompt
    labels[mask == 0] = IGNORE_INDEX
    labels[2, 6] = IGNORE_INDEX  # a hole in the middle
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of every optimizer step a run recorded, in order."""
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def adapter(run: Path) -> dict:
    """The tensors of a run's final adapter, by name."""
    from safetensors.torch import load_file

    return load_file(run / "final" / "adapter_model.safetensors")


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs recorded the same losses and ended with the same adapter, bitwise (floats compared exactly)."""
    import torch

    assert losses(a) == losses(b)
    first, second = adapter(a), adapter(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def run_cli(args: list, env_extra: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`gpupoor ARGS` in a process of its own (python -m gpupoor), its output captured."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "gpupoor", *map(str, args)], env=env, capture_output=True,
                          text=True, **{"timeout": 300, **kwargs})


def signalled_once(command: list, ready: Callable[[], bool], signum: int, env_extra: dict | None = None,
                   poll_s: float = 0.1) -> subprocess.CompletedProcess:
    """`command` in a process of its own, sent `signum` as soon as `ready()` holds (a step or a checkpoint on
    disk: never after a sleep, so a slow machine only waits longer), then waited for; its exit code and output.
    Fails if the process ends before `ready()` holds; the 10-minute bound only ends a hung run."""
    process = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env_extra or {})})
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(poll_s)
        process.send_signal(signum)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def has_a_step(run: Path) -> bool:
    """A run recorded its first optimizer step (the session's start event comes before any step)."""
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and '"loss"' in metrics.read_text()


def pytest_collection_modifyitems(config, items):
    import torch

    here = Path(__file__).parent
    for item in items:
        tier = Path(item.fspath).relative_to(here).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
