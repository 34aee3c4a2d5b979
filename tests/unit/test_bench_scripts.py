"""bench/ drives gpupoor through its modules: a rename there must fail here, in the suite, not in a benchmark run
weeks later. Each script is imported (its module-level imports of gpupoor and of the other bench scripts
resolved); the two that belong on a GPU machine are compiled only: cuda_workspace measures at import, and
peer_trl_gpu imports TRL, which the GPU session carries."""

from __future__ import annotations

import importlib
import py_compile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
GPU_SIDE = {"cuda_workspace", "peer_trl_gpu"}


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda path: path.name)  # (an id "gpu" would mark it a GPU test)
def test_each_bench_script_imports(path, monkeypatch):
    if path.stem in GPU_SIDE:
        py_compile.compile(str(path), doraise=True)
        return
    monkeypatch.syspath_prepend(str(BENCH))
    importlib.import_module(path.stem)


def test_the_bench_scripts_are_found():
    assert {"time_accuracy", "plan_accuracy", "machine", "gpu"} <= {path.stem for path in BENCH.glob("*.py")}
