"""The bad-input harness: every verb of `gpupoor --help`, every option it takes, listed with the kind of value it
takes; every kind has the bad values a careful or a hostile user would give it. tests/integration/test_harness.py
runs each (verb, option, bad value) once and asserts what every verb owes bad input (exit 2 naming the option or
the file, no traceback, nothing written, the user's files unchanged); tests/system/test_harness_signals.py stops
each verb that writes or serves with SIGINT, SIGTERM and SIGHUP inside its work and asserts that nothing is left
behind. tests/unit/test_harness_table.py fails when a verb or an option has no entry here: a new option is tested
the day it lands.

A verb's entry: `args(world)`, a command line that is good in every part (a run trained once, a recipe, data, a
fresh output path), and `options`, each option (or argument, by its metavar) with its kind. A case swaps one
part for one bad value, so the error it gets is about that part alone."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from support.serve import free_port


@dataclass
class World:
    """The user's files the cases run against (made by the harness test's module fixture)."""

    root: Path
    recipe: Path  # a good recipe for the tiny model
    run: Path  # a run it trained (LoRA, a few steps)
    data: Path  # alpaca rows (training data, and held-out rows for eval)
    lf: Path  # a LLaMA-Factory YAML
    _fresh: int = 0

    def fresh(self, name: str) -> Path:
        """A path nothing is at (an output a good command line would create)."""
        self._fresh += 1
        return self.root / "outputs" / f"{self._fresh}-{name}"

    # Bad paths, each made once by `make_world`'s caller (world.make_bad_files).
    def missing(self, suffix: str) -> Path:
        return self.root / "no-such-folder" / f"missing{suffix}"

    @property
    def folder(self) -> Path:
        return self.root / "a-folder"

    @property
    def plain_file(self) -> Path:
        return self.root / "notes.txt"

    def latin1(self, suffix: str) -> Path:
        return self.root / f"latin1{suffix}"

    def binary(self, suffix: str) -> Path:
        return self.root / f"binary{suffix}"

    def make_bad_files(self) -> None:
        self.folder.mkdir(exist_ok=True)
        self.plain_file.write_text("a user's notes\n")
        for suffix in SUFFIXES:
            self.latin1(suffix).write_bytes(b"caf\xe9 = 1\n{\"instruction\": \"caf\xe9\"}\n")
            self.binary(suffix).write_bytes(bytes(range(256)) * 4 + b"\x00" * 64)


def build_world(root: Path, tiny_model: Path) -> World:
    """The user's files: rows, a recipe for the tiny model, a run it trained (2 steps), a LLaMA-Factory folder that
    converts cleanly, the bad files, and outputs/ where the good command lines write."""
    import json

    import pytest
    import yaml

    from support.cli import invoke
    from support.recipes import write_recipe
    from support.rows import alpaca_rows, write_jsonl

    data = write_jsonl(root / "rows.jsonl", alpaca_rows(24))
    recipe = write_recipe(root / "recipe.yaml", tiny_model, data, training={"max_steps": 2})
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("GPUPOOR_CACHE", str(root / "cache"))
        result = invoke("train", recipe, "--output-dir", root / "run", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    (root / "lf-data").mkdir()
    (root / "lf-data" / "identity.json").write_text(json.dumps(alpaca_rows(8)))
    (root / "lf-data" / "dataset_info.json").write_text(json.dumps({"identity": {"file_name": "identity.json"}}))
    lf = root / "lf.yaml"
    lf.write_text(yaml.safe_dump({"model_name_or_path": "gpupoor:demo", "stage": "sft", "finetuning_type": "lora",
                                  "dataset": "identity", "dataset_dir": "lf-data", "learning_rate": 1e-4}))
    world = World(root, recipe, root / "run", data, lf)
    world.make_bad_files()
    (root / "outputs").mkdir()
    return world


SUFFIXES = (".yaml", ".jsonl", ".txt", ".gguf", ".json", ".html")


@dataclass(frozen=True)
class Bad:
    """One bad value: its label, the value (from the world), and what the message may name besides the option."""

    label: str
    value: Callable[[World], str]
    names_value: bool = False  # a path: naming it (or the option) is naming the problem


def _path(label: str, make: Callable[[World], Path]) -> Bad:
    return Bad(label, lambda world: str(make(world)), names_value=True)


def _text(label: str, value: str) -> Bad:
    return Bad(label, lambda world: value)


def input_file(suffix: str) -> list[Bad]:
    """A file the verb reads."""
    return [_path("missing", lambda w: w.missing(suffix)), _path("a folder", lambda w: w.folder),
            _path("not UTF-8", lambda w: w.latin1(suffix)), _path("binary", lambda w: w.binary(suffix))]


def output_file(suffix: str, *inputs: Callable[[World], Path], new: bool = True) -> list[Bad]:
    """A file the verb writes: where it cannot be written, over a file the command line reads, and (`new`: an output
    that must not exist) over any file of the user's."""
    bad = [_path("a folder", lambda w: w.folder), _path("under a file", lambda w: w.plain_file / f"x{suffix}")]
    if new:
        bad.append(_path("an existing file of the user's", lambda w: w.latin1(suffix)))
    return bad + [_path(f"an input ({index})", make) for index, make in enumerate(inputs)]


NEW_DIR = [_path("under a file", lambda w: w.plain_file / "out"), _path("an existing file", lambda w: w.plain_file),
           _path("the run it reads", lambda w: w.run)]
WORK_DIR = [_path("missing", lambda w: w.missing("")), _path("a file", lambda w: w.plain_file)]
RUN = [_path("missing", lambda w: w.missing("")), _path("a file", lambda w: w.plain_file),
       _path("an empty folder", lambda w: w.folder), _path("binary file", lambda w: w.binary(".gguf"))]
RECIPE = input_file(".yaml") + [_path("an empty folder's name", lambda w: w.folder)]
MALFORMED = [_text("letters", "abc"), _text("empty", "")]
INT_MIN1 = MALFORMED + [_text("zero", "0"), _text("negative", "-1"), _text("a fraction", "1.5"),
                        _text("NaN", "nan"), _text("inf", "inf")]
HUGE = [_text("huge", "9" * 24)]
INT_MIN0 = MALFORMED + [_text("negative", "-1"), _text("NaN", "nan")]
FLOAT_GE0 = MALFORMED + [_text("negative", "-1"), _text("NaN", "nan"), _text("inf", "inf"), _text("huge", "1e400")]
DURATION = MALFORMED + [_text("negative", "-5m"), _text("zero", "0"), _text("NaN", "nan"), _text("inf", "inf"),
                        _text("huge", "1e400"), _text("a unit typo", "5x")]
SIZE = MALFORMED + [_text("negative", "-1GB"), _text("zero", "0"), _text("NaN", "nan"), _text("inf", "inf"),
                    _text("huge", "1e400"), _text("a unit typo", "5XB")]
PORT = MALFORMED + [_text("zero", "0"), _text("negative", "-1"), _text("past 65535", "70000")]
CHECKPOINT = [_text("not a step", "step-x"), _text("a step it lacks", "step-999999"), _text("a path", "../final")]
SET = [_text("no =", "training.max_steps"), _text("an unknown key", "training.no_such_key=1"),
       _text("a bad value", "training.max_steps=abc"), _text("non-finite", "training.learning_rate=.nan")]


def choice(*bad: str) -> list[Bad]:
    return [_text(f"not one of the choices ({value})", value) for value in bad]


LAUNCH = {"--nproc-per-node": INT_MIN1 + HUGE, "--nnodes": [_text("without --nproc-per-node", "2")],
          "--node-rank": INT_MIN0, "--master-addr": [_text("without --nproc-per-node", "10.0.0.1")],
          "--master-port": PORT, "--rdzv-endpoint": [_text("without --nproc-per-node", "host:1")]}
FLAG: list[Bad] = []  # a switch takes no value: nothing to get wrong


@dataclass(frozen=True)
class Verb:
    args: Callable[[World], list[str]]  # a command line good in every part
    options: dict[str, list[Bad]]  # every option and argument (by metavar) -> its bad values
    # writes or serves: stopped by each signal inside its work in tests/system/test_harness_signals.py
    signals: bool = False


def _flags(*names: str) -> dict[str, list[Bad]]:
    return {name: FLAG for name in ("--debug", *names)}


VERBS: dict[str, Verb] = {
    "train": Verb(lambda w: [w.recipe, "--output-dir", w.fresh("run")], {
        "RECIPE": RECIPE, "--set": SET, "--output-dir": NEW_DIR, "--time-limit": DURATION,
        "--profile": INT_MIN1 + HUGE, **LAUNCH, **_flags("--smoke", "--force", "--resume-if-present")}, signals=True),
    "resume": Verb(lambda w: [w.run], {
        "RUN_DIR": RUN, "--set": SET, "--time-limit": DURATION, "--profile": INT_MIN1 + HUGE, **LAUNCH,
        **_flags("--force")}, signals=True),
    "status": Verb(lambda w: [w.run], {"RUN_DIR": RUN, **_flags()}),
    "report": Verb(lambda w: [w.run, "--output", w.fresh("report.html")], {
        "RUN_DIRS": RUN, "--output": output_file(".html", new=False) + [_text("not .html or .png", "report.txt")],
        **_flags("--log-scale")}, signals=True),
    "merge-lora": Verb(lambda w: [w.run, "--output", w.fresh("merged")], {
        "SOURCE": RUN, "--output": NEW_DIR, "--checkpoint": CHECKPOINT, "--dtype": choice("fp8", "float32x"),
        "--base": [_path("missing", lambda w: w.missing(""))], "--max-shard-size": SIZE,
        "--qlora-base": choice("quantized"), **_flags("--verify", "--skip-manifest-check", "--force")},
        signals=True),
    "export": Verb(lambda w: [w.run, "--output", w.fresh("model.gguf"), "--quant", "q8_0"], {
        "SOURCE": RUN, "--quant": choice("q3_bogus", ""), "--format": choice("onnx"),
        "--output": output_file(".gguf", lambda w: w.run / "final" / "adapter_model.safetensors"),
        "--checkpoint": CHECKPOINT, "--eval": input_file(".txt"), "--eval-tokens": INT_MIN1,
        "--work-dir": WORK_DIR, **_flags("--quality", "--force")}, signals=True),
    "eval": Verb(lambda w: [w.run, "--data", w.data, "--output", w.fresh("eval.json")], {
        "SOURCE": RUN, "--data": input_file(".jsonl"),
        "--pass-if": [_text("three dots", "exact>=1.2.3"), _text("unknown metric", "bleu>=0.5"),
                      _text("NaN", "exact>=nan"), _text("no comparison", "exact"),
                      _text("more general questions than asked", "general>=3")],
        "--tasks": [_path("a missing task file", lambda w: w.missing(".yaml"))],
        "--metric": [_text("unknown", "bleu"), _text("a bad regex", "regex:(")], "--checkpoint": CHECKPOINT,
        "--limit": INT_MIN1, "--max-new-tokens": INT_MIN1,
        "--output": output_file(".json", lambda w: w.data, new=False), **_flags("--general", "--force")}, signals=True),
    "serve": Verb(lambda w: [w.run, "--port", str(free_port())], {
        "SOURCE": RUN, "--checkpoint": CHECKPOINT, "--host": [_text("not an address", "bad host!")],
        "--port": PORT, "--work-dir": WORK_DIR, "--served-model-name": [_text("empty", "")],
        "--request-time-limit": DURATION, **_flags("--force")}, signals=True),
    "convert-recipe": Verb(lambda w: [w.lf, "--output", w.fresh("converted.yaml")], {
        "THEIRS": RECIPE, "--output": output_file(".yaml", lambda w: w.lf), **_flags("--force")}, signals=True),
    "generate": Verb(lambda w: [w.run, "--prompt", "hi", "--max-new-tokens", "2"], {
        "SOURCE": RUN, "--prompt": [_text("empty", "")], "--file": input_file(".jsonl"), "--checkpoint": CHECKPOINT,
        "--max-new-tokens": INT_MIN1, "--temperature": FLOAT_GE0, "--format": choice("markdown"),
        "--base": [_path("missing", lambda w: w.missing(""))], **_flags("--force")}),
    "chat": Verb(lambda w: [w.run, "--max-new-tokens", "2"], {
        "SOURCE": RUN, "--checkpoint": CHECKPOINT, "--max-new-tokens": INT_MIN1, "--temperature": FLOAT_GE0,
        "--base": [_path("missing", lambda w: w.missing(""))], **_flags("--force", "--history")}),
    "validate": Verb(lambda w: [w.recipe], {"RECIPES": RECIPE, "--set": SET, "--show": INT_MIN0,
                                            **_flags("--force")}),
    "plan": Verb(lambda w: [w.recipe, "--no-time"], {
        "RECIPE": RECIPE, "--set": SET, "--device": choice("tpu"), "--memory": SIZE, "--processes": INT_MIN1 + HUGE,
        "--nodes": INT_MIN1, "--time-limit": DURATION, "--gpu": [_text("unknown", "NOSUCHGPU")],
        "--threads": INT_MIN1 + HUGE, **_flags("--json", "--fit", "--time")}, signals=True),
    "tokenize": Verb(lambda w: [w.recipe, "--output", w.fresh("tokenized")], {
        "RECIPE": RECIPE, "--output": NEW_DIR, "--set": SET, **_flags()}, signals=True),
    "schema": Verb(lambda w: [], {}),
}


def command_line(verb: str, option: str, value: str, world: World) -> list[str]:
    """The verb's good command line with `option` (an option, or an argument's metavar) set to `value`."""
    args = [str(a) for a in VERBS[verb].args(world)]
    if not option.startswith("-"):  # the argument: the good line's first word
        return [verb, value, *args[1:]]
    if option in args:
        at = args.index(option)
        return [verb, *args[:at + 1], value, *args[at + 2:]]
    return [verb, *args, option, value]


def cases() -> list[tuple[str, str, Bad]]:
    return [(verb, option, bad) for verb, entry in VERBS.items() for option, bads in entry.options.items()
            for bad in bads]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under the world with what a write would change (a file's size, mtime, inode)."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "cache"]  # the test's own gpupoor cache
        for name in [*dirs, *files]:
            path = Path(folder) / name
            stat = path.lstat()
            # (a folder by its entries alone: a probe file made and removed again to test that an output folder
            # can be written leaves nothing, though the folder's mtime moves)
            seen[str(path.relative_to(root))] = (stat.st_mode,) if path.is_dir() and not path.is_symlink() else \
                (stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_mode)
    return seen


def content_hashes(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and "cache" not in path.relative_to(root).parts}
