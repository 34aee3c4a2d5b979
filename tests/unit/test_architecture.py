"""The shape docs/architecture.md describes: packages in one import order, no import cycles (function-level
imports included), leaves that import nothing upward, no function longer than a page and a half, no module
longer than ~600 lines unless its first lines say why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpupoor"
MAX_FUNCTION_LINES = 80
LEAVES = {"gpupoor.errors": set(), "gpupoor.storage.files": set(), "gpupoor.units": {"gpupoor.errors"},
          "gpupoor.train.state": set(), "gpupoor.optimizers": set(), "gpupoor.method_table": set(),
          "gpupoor.objective_table": set(),
          "gpupoor.decisions": {"gpupoor.errors", "gpupoor.method_table", "gpupoor.objective_table", "gpupoor.optimizers"},
          "gpupoor.storage.rundir": {"gpupoor.errors", "gpupoor.storage.files", "gpupoor.recipe.schema",
                                     "gpupoor.recipe.loading", "gpupoor.units"},
          "gpupoor.recipe.rules": {"gpupoor.errors", "gpupoor.decisions", "gpupoor.method_table", "gpupoor.objective_table",
                                   "gpupoor.optimizers"},
          "gpupoor.recipe.schema": {"gpupoor.errors", "gpupoor.method_table", "gpupoor.objective_table",
                                    "gpupoor.optimizers", "gpupoor.units",
                                    "gpupoor.recipe.rules", "gpupoor.scorers"},
          "gpupoor.scorers": {"gpupoor.errors"},
          "gpupoor.recipe.loading": {"gpupoor.errors", "gpupoor.recipe.schema", "gpupoor.recipe.peer_keys"},
          "gpupoor.recipe.peer_keys": set(),
          "gpupoor.recipe.diff": {"gpupoor.recipe.schema"}}
# The import order of docs/architecture.md: a part imports only the parts before it (and itself). The top-level
# modules before `recipe` are utilities any part may use; `cli` (and `__main__`) come last.
ORDER = ["errors", "process", "scorers", "units", "faults", "profiling", "quiet", "optimizers", "method_table", "objective_table", "decisions", "cpu", "hardware", "recipe", "storage",
         "data", "model", "objectives", "train", "plan", "export", "run", "commands", "scripts", "outcome", "verb", "cli", "__main__"]
MAX_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of ours that `path` imports anywhere (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name in modules and name != "gpupoor":
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    # `from gpupoor.x import y` names both gpupoor.x and (when it exists) gpupoor.x.y: keep the deepest only
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not any(o != t and o.startswith(t + ".") for o in targets)} - {name}
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if state.get(target) is None:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_leaves_import_only_leaves():
    graph = _graph()
    for leaf, allowed in LEAVES.items():
        assert graph[leaf] <= allowed, f"{leaf} imports {sorted(graph[leaf] - allowed)}"


def _part(module: str) -> str:
    return module.split(".")[1]


def test_every_module_is_in_a_known_part():
    unknown = sorted(name for name in _modules() if name != "gpupoor" and _part(name) not in ORDER)
    assert not unknown, f"add these to ORDER and to docs/architecture.md: {unknown}"


def test_parts_import_only_the_parts_before_them():
    graph = _graph()
    upward = [f"{name} -> {target}" for name, targets in sorted(graph.items()) for target in sorted(targets)
              if ORDER.index(_part(target)) > ORDER.index(_part(name))]
    assert not upward, upward


def test_no_module_is_longer_than_600_lines_without_saying_why():
    long = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES and not any("longer than 600 lines" in line for line in lines[:15]):
            long.append(f"{path.relative_to(PACKAGE)} ({len(lines)} lines)")
    assert not long, long


def test_no_verb_borrows_from_the_orchestrator():
    graph = _graph()
    # the CLI (the start-up clock), its outcome policy (stop signals noted from a train's first line) and the train
    # verb (commands/train.py) start processes
    launching = {"gpupoor.run.launch", "gpupoor.run.signals", "gpupoor.run.startup"}
    orchestration = {name for name in _modules() if name.startswith("gpupoor.run.")} - launching
    users = sorted(name for name, targets in graph.items() if not name.startswith("gpupoor.run.")
                   and targets & orchestration)
    assert users == ["gpupoor.commands.train", "gpupoor.scripts.demo"], users
    launchers = sorted(name for name, targets in graph.items() if not name.startswith("gpupoor.run.")
                       and targets & launching)
    assert launchers == ["gpupoor.cli", "gpupoor.commands.train", "gpupoor.outcome"], launchers


# The verbs (gpupoor/commands/) import no other verb: what two of them share is a library in a layer below them
# (generation in model/, merging in model/merge.py, a line of standard input in data/). The pairs that may, each
# with why; a pair that no longer imports is taken off the list (the test fails until it is).
ALLOWED_VERB_IMPORTS = {
    ("gpupoor.commands.eval", "gpupoor.commands.eval_tasks"): "eval's lm-evaluation-harness tasks: its own second module",
    ("gpupoor.commands.serve", "gpupoor.commands.serve_requests"): "serve's OpenAI requests: its own second module",
    ("gpupoor.commands.train", "gpupoor.commands.validate"): "train runs validate's preflight before it builds",
    ("gpupoor.commands.train", "gpupoor.commands.report"): "a finished run draws report.html as `gpupoor report` does",
}


def test_no_verb_imports_another_but_the_pairs_listed():
    graph = _graph()
    verbs = {name for name in _modules() if name.startswith("gpupoor.commands.")}
    pairs = {(name, target) for name in verbs for target in graph.get(name, ()) if target in verbs and target != name}
    assert not pairs - set(ALLOWED_VERB_IMPORTS), sorted(pairs - set(ALLOWED_VERB_IMPORTS))
    assert not set(ALLOWED_VERB_IMPORTS) - pairs, f"no longer imported: {sorted(set(ALLOWED_VERB_IMPORTS) - pairs)}"


def test_no_function_is_longer_than_a_page_and_a_half():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}::{node.name} ({length} lines)")
    assert not long, long


def test_the_import_checker_sees_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from gpupoor.run.orchestrate import train_from_recipe\n    import gpupoor.storage.files\n")
    assert _imports(source, _modules()) == {"gpupoor.run.orchestrate", "gpupoor.storage.files"}


def test_the_architecture_doc_has_a_row_per_module_with_its_imports():
    """docs/architecture.md's module tables are what a newcomer reads: every module has a row, and its imports
    column names exactly what it imports (they drifted when they were kept by hand)."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    modules_part = doc[doc.index("## The modules"):]
    rows = {}
    for line in modules_part.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 3 and cells[0][3:].split("`")[0].endswith(".py"):
            name = "gpupoor." + cells[0][3:].split("`")[0][:-3].replace("/", ".")
            rows[name] = set(re.findall(r"`([\w.]+)`", cells[-1]))
    graph = _graph()
    modules = {name for name in _modules() if name != "gpupoor" and not _modules()[name].name == "__init__.py"}
    assert sorted(modules - set(rows)) == [], "modules with no row in docs/architecture.md"
    wrong = {name: sorted({t[len("gpupoor."):] for t in graph[name]} ^ rows[name])
             for name in modules if {t[len("gpupoor."):] for t in graph[name]} != rows[name]}
    assert not wrong, f"imports columns that differ from the code (names in one but not the other): {wrong}"


def test_the_unit_tier_mirrors_the_packages_folders_and_test_names_are_unique():
    """tests/unit/PART/ holds the tests of gpupoor/PART/ (docs/architecture.md, The tests); pytest imports every
    test file by its name alone (no __init__.py), so two files of one name anywhere under tests/ would collide."""
    tests = PACKAGE.parent / "tests"
    unit = tests / "unit"
    folders = {path.parent.relative_to(unit) for path in unit.rglob("test_*.py")} - {Path(".")}
    assert folders and all((PACKAGE / folder).is_dir() for folder in folders), sorted(map(str, folders))
    names = [path.name for path in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)
