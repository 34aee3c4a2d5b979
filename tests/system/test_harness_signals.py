"""The bad-input harness's signal cases (tests/support/harness.py): every verb that writes or serves, in a process
of its own, stopped by SIGINT, SIGTERM and SIGHUP inside its work (gpupoor.faults: `ACTION@working`, once it has
begun what it writes; train and resume after an optimizer step). Each must end with the signal's exit code (train
and resume: a checkpoint and 75), one line and no traceback, leave no scratch anywhere (its temporary folder is
empty, no partial output beside the user's files) and every file of the user's byte-identical."""

from __future__ import annotations

import shutil
import signal

import pytest

from support.cli import run_cli
from support.harness import VERBS, World, build_world, content_hashes, snapshot

SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP}
STOPPED_SAYS = {"sigint": "interrupted", "sigterm": "stopped by SIGTERM", "sighup": "stopped by SIGHUP"}
CHECKPOINTING = ("train", "resume")  # they stop with a checkpoint, exit 75
SIGNALLED = [(verb, action) for verb, entry in VERBS.items() if entry.signals for action in SIGNALS]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model) -> World:
    world = build_world(tmp_path_factory.mktemp("signal-world"), tiny_model)
    # resume's run: stopped with a checkpoint after step 1 of 4 (each case resumes a copy of it)
    result = run_cli(["train", world.recipe, "--output-dir", world.root / "stopped", "--set", "training.max_steps=4"],
                     {"GPUPOOR_FAULT": "sigterm@1", "GPUPOOR_CACHE": str(world.root / "cache")})
    assert result.returncode == 75, result.stderr
    return world


def signalled_line(verb: str, world: World, case_root) -> list[str]:
    """The verb's good command line; resume's on a copy of the stopped run."""
    if verb == "resume":
        copy = case_root / "stopped-copy"
        shutil.copytree(world.root / "stopped", copy)
        return ["resume", str(copy)]
    return [verb, *map(str, VERBS[verb].args(world))]


@pytest.mark.parametrize("verb, action", SIGNALLED, ids=[f"{v} {a}" for v, a in SIGNALLED])
def test_a_signal_inside_the_work_leaves_nothing_behind(world, verb, action, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    args = signalled_line(verb, world, tmp_path)
    fault = f"{action}@{2 if verb == 'resume' else 1}" if verb in CHECKPOINTING else f"{action}@working"
    before, hashes = snapshot(world.root), content_hashes(world.root)
    result = run_cli(args, {"GPUPOOR_FAULT": fault, "TMPDIR": str(scratch), "GPUPOOR_CACHE": str(world.root / "cache")},
                     cwd=world.root)
    shown = f"gpupoor {' '.join(args)} with {fault}: exit {result.returncode}\n{result.stderr[-3000:]}"
    expected = 75 if verb in CHECKPOINTING else 128 + SIGNALS[action]
    assert result.returncode == expected, shown
    assert "Traceback" not in result.stderr, shown
    if verb not in CHECKPOINTING:
        assert result.stderr.strip().splitlines()[-1] == STOPPED_SAYS[action], shown
    else:
        said = result.stdout + result.stderr
        assert "saving a checkpoint" in said and "gpupoor resume" in said, f"{shown}\n{result.stdout[-2000:]}"
    after = snapshot(world.root)
    new = sorted(path for path in set(after) - set(before) if not path.startswith("outputs/") or
                 verb != "train")
    assert new == [], f"left behind: {new}\n{shown}"
    assert sorted(scratch.iterdir()) == [], f"left in its temporary folder\n{shown}"
    now = content_hashes(world.root)
    assert {path: now.get(path) for path in hashes} == hashes, f"changed the user's files\n{shown}"
    if verb in CHECKPOINTING:  # what the stop leaves is a run that resumes
        run = args[args.index("--output-dir") + 1] if verb == "train" else args[1]
        resumed = run_cli(["resume", run], {"GPUPOOR_CACHE": str(world.root / "cache")}, cwd=world.root)
        assert resumed.returncode == 0, resumed.stderr


def test_sighup_from_a_terminal_that_closed_still_ends_in_a_checkpoint(world, tmp_path):
    """A dropped ssh session: the terminal is gone, so every write to it fails (EIO), then SIGHUP arrives. The
    stop's own lines raised OSError and the run ended with exit 1 and no checkpoint; now its output goes to
    /dev/null, as nohup would have sent it, and it stops as for any other signal."""
    import os
    import select
    import subprocess
    import sys
    import time

    from support.runs import has_a_step

    master, terminal = os.openpty()
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpupoor", "train", str(world.recipe), "--output-dir", str(run), "--set",
         "training.max_steps=100000", "--set", "logging.progress=none"], stdin=terminal, stdout=terminal,
        stderr=terminal, env={**os.environ, "GPUPOOR_CACHE": str(world.root / "cache"), "TMPDIR": str(tmp_path)},
        start_new_session=True)
    os.close(terminal)
    try:
        deadline = time.monotonic() + 300
        while not has_a_step(run):  # read what it writes, so the terminal's buffer never fills
            assert process.poll() is None and time.monotonic() < deadline
            if select.select([master], [], [], 0.1)[0]:
                os.read(master, 65536)
        os.close(master)  # the terminal hangs up: writes to it fail from now on
        process.send_signal(signal.SIGHUP)
        assert process.wait(timeout=300) == 75
    finally:
        process.kill()
    assert sorted(path.name for path in (run / "checkpoints").iterdir() if path.name.startswith("step-"))
