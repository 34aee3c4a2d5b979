"""Fixtures: a tokenizer trained here, tiny random-weight Llamas saved with save_pretrained, data files, a recipe
maker, the real model. Nothing is downloaded: HF_HUB_OFFLINE makes an accidental download fail. The helpers test
files import by name live in tests/support/ (cli: invoke; runs: read_metrics, reference_runs; rows; recipes).

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
`conftest` in sys.modules for the files collected after it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

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

from support.recipes import write_recipe  # noqa: E402
from support.rows import alpaca_rows, sentence, write_jsonl  # noqa: E402


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
    texts = [alpaca_prompt(sentence(rng, 2, 9), sentence(rng, 0, 5)) + sentence(rng, 1, 9) for _ in range(300)]
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
    texts = [alpaca_prompt(sentence(rng, 2, 9), sentence(rng, 0, 5)) + sentence(rng, 1, 9) for _ in range(300)]
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


@pytest.fixture()
def make_recipe(tmp_path, tiny_model, alpaca_file):
    """Write a recipe for the tiny model; keyword sections are merged over sensible test defaults."""

    def make(name: str = "recipe.yaml", **sections) -> Path:
        return write_recipe(tmp_path / name, tiny_model, alpaca_file, **sections)

    return make


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
