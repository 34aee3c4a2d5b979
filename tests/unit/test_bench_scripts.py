"""bench/ drives gpupoor through its modules: a rename there must fail here, in the suite, not in a benchmark run
weeks later. Each script is imported (its module-level imports of gpupoor and of the other bench scripts
resolved); the two that belong on a GPU machine are compiled only: cuda_workspace measures at import, and
peer_trl_gpu imports TRL, which the GPU session carries."""

from __future__ import annotations

import importlib
import importlib.util
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


def _gpupoor_imports():
    """Every `from gpupoor... import name` in bench/, function-level ones too, as (script, module, name)."""
    import ast

    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gpupoor":
                for alias in node.names:
                    yield path.name, node.module, alias.name


def test_every_gpupoor_name_bench_uses_exists_and_is_public():
    """The imports inside the scripts' functions run only in a benchmark: each is resolved here, and none reaches
    for a private name (a leading underscore), which gpupoor may rename without notice."""
    found = list(_gpupoor_imports())
    assert len(found) > 40  # the walk sees the function-level imports
    for script, module, name in found:
        assert not name.startswith("_") or name == "__version__", f"{script}: {module}.{name} is private"
        assert hasattr(importlib.import_module(module), name) or \
            importlib.util.find_spec(f"{module}.{name}") is not None, f"{script}: {module}.{name} does not exist"
