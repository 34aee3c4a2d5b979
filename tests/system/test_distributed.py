"""Several processes on this CPU (gloo): FSDP2 and two "nodes" train like one process accumulating their
micro-batches; a signal to one process stops them all with one checkpoint; sharded checkpoints resume bitwise,
refuse another process count unless --force, and survive a process that dies mid-save; one command line for a
requeued batch job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from support.cli import invoke, signalled_once
from support.rows import alpaca_rows, write_jsonl
from support.runs import has_a_step, read_metrics
from support.distributed import RECIPE, TORCHRUN, exit_codes, losses, one_process, recipe, torchrun

FSDP = ["--set", "distributed.strategy=fsdp"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(*args, env_extra: dict | None = None) -> list[subprocess.CompletedProcess]:
    """torchrun's multi-node rendezvous with two "nodes" of one process each on this machine."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([TORCHRUN, "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "-m", "gpupoor",
                               *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "GPUPOOR_FAULT": "", **(env_extra or {})})
             for rank in (0, 1)]
    return [subprocess.CompletedProcess(node.args, node.wait(timeout=300), *node.communicate()) for node in nodes]


def aborting_teardown(folder: Path) -> dict[str, str]:
    """The environment of a launch whose training processes each abort if they reach the interpreter's teardown (an
    atexit hook that always aborts). gloo's threads and sockets outlive destroy_process_group, and tearing them
    down with the interpreter aborted a process now and then (SIGABRT after a run that succeeded; on two nodes the
    other node's torchrun then waited 300 s at its exit barrier). Once its part is over a process ends without that
    teardown, so a launch under this environment ends as it would without it: the two-node run that succeeds
    (test_fsdp_and_two_nodes_...) and a DDP run stopped by SIGTERM (test_a_whole_optimizer_pt_...[ddp])."""
    hook = folder / "teardown-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text('import atexit, os\n'
                                           'if "LOCAL_RANK" in os.environ:\n    atexit.register(os.abort)\n')
    return {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}


def adapter(run: Path, where: str = "final") -> dict[str, torch.Tensor]:
    return load_file(run / where / "adapter_model.safetensors")


def close(a: dict, b: dict, tolerance: float = 1e-5) -> bool:
    """Equal to rounding, relative to each tensor's norm (gradients meet through gloo's all-reduce or
    reduce-scatter instead of in-place accumulation)."""
    return a.keys() == b.keys() and all(
        (a[k].double() - b[k].double()).norm() <= tolerance * b[k].double().norm() + 1e-12 for k in a)


@pytest.fixture(scope="module")
def straight(recipe, once_per_session):
    """straight(layout, *changes) -> the run dir of an uninterrupted run of `recipe` with `--set` changes: `one`
    (one process accumulating two micro-batches: the test's own), `ddp` or `fsdp` (two processes); each trained
    once per test session, by whichever worker asks first (each run takes two processes several seconds to start)."""
    def train(layout: str, changes: tuple, folder: Path) -> None:
        folder.mkdir()
        target = folder / "run"
        if layout == "one":  # in this process, as the integration tier trains: no ~10 s of imports to start one
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setenv("GPUPOOR_CACHE", str(folder / "cache"))
                trained = invoke("train", recipe, "--output-dir", target, "--set",
                                 "training.gradient_accumulation_steps=2", *changes, monkeypatch=monkeypatch)
            assert trained.exit_code == 0, trained.output[-2000:]
            return
        result = torchrun("train", recipe, "--output-dir", target, "--set", f"distributed.strategy={layout}",
                          *changes)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert f"processes: 2 ({layout.upper()}, gloo" in result.stdout

    def run(layout: str, *changes: str) -> Path:
        return once_per_session(["test_distributed straight", RECIPE, layout, changes],
                                lambda folder: train(layout, changes, folder)) / "run"

    return run


@pytest.mark.slow
def test_fsdp_and_two_nodes_train_like_one_process_accumulating(recipe, straight, tmp_path):
    """Two nodes (under `aborting_teardown`: each process ends without the interpreter's teardown) and FSDP train
    like one process accumulating; FSDP's checkpoint holds the optimizer as DCP shards."""
    nodes = two_nodes("train", recipe, "--output-dir", tmp_path / "nodes", env_extra=aborting_teardown(tmp_path))
    assert [node.returncode for node in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]
    assert "processes: 2 on 2 nodes (DDP, gloo" in nodes[0].stdout + nodes[1].stdout
    reference = losses(straight("one"))
    assert len([r for r in reference if r[1] is not None]) == 4
    for run in (straight("fsdp"), tmp_path / "nodes"):
        for (step, loss, eval_loss), (step_b, loss_b, eval_b) in zip(reference, losses(run), strict=True):
            assert step == step_b
            assert loss == pytest.approx(loss_b, rel=1e-5) if loss is not None else loss_b is None
            assert eval_loss == pytest.approx(eval_b, rel=1e-5) if eval_loss is not None else eval_b is None
        assert close(adapter(straight("one")), adapter(run)), run
    # FSDP's checkpoint: the same adapter layout, the optimizer state as DCP shards with the groups as JSON.
    checkpoint = straight("fsdp") / "checkpoints" / "step-000004"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["optimizer"] == "dcp" and manifest["processes"] == 2 and manifest["strategy"] == "fsdp"
    assert {"optimizer/.metadata", "optimizer/param_groups.json", "adapter_model.safetensors"} <= manifest["files"].keys()
    assert sum(name.endswith(".distcp") for name in manifest["files"]) == 2  # one shard per process
    assert not (checkpoint / "optimizer.pt").exists()


def stopped_by_rank1_at_step_3(stopped: subprocess.CompletedProcess, run: Path, why: str) -> None:
    """A stop that reached or came from the process of rank 1 alone after step 3 stopped every process there,
    with one checkpoint (step 3's, beside the scheduled step 2). (Each caller checks the exit codes its launch
    reports.)"""
    assert f"{why}: stopped after step 3 with checkpoint checkpoints/step-000003" in stopped.stdout, \
        stopped.stdout[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000003"]


@pytest.mark.slow
def test_a_stop_on_one_process_stops_all_at_one_step_and_resumes_bitwise(recipe, straight, tmp_path):
    """SIGTERM reaches the process of rank 1 only (SLURM may signal some processes and not others). With dropout
    every process draws its own masks: a resume restores each process's RNG, not the first's. Two eval rows are
    one eval batch for two processes: the second has none of its own and must not hang the first, before the stop
    and after the resume. (The same stop under FSDP: test_a_process_dying_mid_save_leaves_the_previous_checkpoint;
    rank 1 alone finding its time limit reached: test_one_launch_exits_75_when_every_process_stopped_and_...)"""
    changes = ["--set", "peft.dropout=0.2", "--set", "data.eval_rows=2"]
    run = tmp_path / "run"
    stopped = torchrun("train", recipe, "--output-dir", run, "--set", "distributed.strategy=ddp", *changes,
                       fault="rank1/sigterm@3")
    assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]
    stopped_by_rank1_at_step_3(stopped, run, "stop requested on another process")
    state = json.loads((run / "checkpoints" / "step-000003" / "train_state.json").read_text())
    assert len(state["rng_by_rank"]) == 2 and state["rng_by_rank"][0] != state["rng_by_rank"][1]
    resumed = torchrun("resume", run)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    reference = straight("ddp", *changes)
    assert losses(run) == losses(reference)
    assert [step for step, _, eval_loss in losses(run) if eval_loss is not None] == [2, 4]
    a, b = adapter(reference), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same layout: bitwise


@pytest.mark.slow
def test_fsdp_resume_on_another_process_count_is_refused_then_forced(recipe, tmp_path, monkeypatch):
    run = tmp_path / "run"
    stopped = torchrun("train", recipe, "--output-dir", run, *FSDP, fault="sigterm@2")
    assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]
    # The one-process resumes run in this process (no ~10 s of imports to start one each)
    refused = invoke("resume", run, monkeypatch=monkeypatch)
    assert refused.exit_code == 2, refused.output[-2000:]
    assert "processes: 2 -> 1" in refused.stderr and "--force" in refused.stderr
    forced = invoke("resume", run, "--force", monkeypatch=monkeypatch)
    assert forced.exit_code == 0, forced.output[-2000:]
    assert "processes 2 -> 1" in forced.stdout
    # DCP resharded the two processes' optimizer shards into this one's: AdamW's step count carried over
    # (a fresh optimizer would count 2 steps at step 4).
    optimizer = torch.load(run / "checkpoints" / "step-000004" / "optimizer.pt", weights_only=True)
    assert optimizer["state"] and all(int(s["step"]) == 4 for s in optimizer["state"].values())
    assert (run / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_a_process_dying_mid_save_leaves_the_previous_checkpoint(recipe, straight, tmp_path):
    """Under FSDP: SIGTERM reaches rank 1 only after step 3 and every process stops there; resumed, rank 1 dies in
    the middle of step 4's save (weights gathered, its optimizer shard not yet written), which leaves step 3's
    checkpoint; resumed again, the run ends bitwise where the run that never stopped ends. (Stop and death share
    one run: each launch of two processes costs ~20 s of start-up.)"""
    run = tmp_path / "run"
    stopped = torchrun("train", recipe, "--output-dir", run, *FSDP, fault="rank1/sigterm@3")
    assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]
    stopped_by_rank1_at_step_3(stopped, run, "stop requested on another process")
    died = torchrun("resume", run, fault="rank1/kill@gathered:4")
    assert died.returncode != 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["step-000002", "step-000003"]
    resumed = torchrun("resume", run)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "removed an incomplete checkpoint write" in resumed.stdout
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert losses(run) == losses(straight("fsdp"))
    a, b = adapter(straight("fsdp")), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same layout: bitwise


def launched(*args, fault: str = "") -> subprocess.CompletedProcess:
    """`gpupoor ARGS --nproc-per-node 2`: one process that launches the two (torch.distributed.run, in it)."""
    return one_process(*args, "--nproc-per-node", "2", fault=fault)


@pytest.mark.slow
def test_a_changed_base_is_refused_by_every_process(recipe, tiny_model, tmp_path):
    """The first process identifies the models; the others must get its verdict: alone, they went on into the
    next collective and died there (or of the launcher's SIGTERM) while it exited 2."""
    from safetensors.torch import save_file

    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    run = tmp_path / "run"
    stopped = torchrun("train", recipe, "--output-dir", run, "--set", f"model.name_or_path={base}", "--set",
                       "distributed.strategy=ddp", fault="timeout@2")
    assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]
    weights = load_file(base / "model.safetensors")  # same shapes, other values, at the same path
    save_file({name: tensor + 0.01 for name, tensor in weights.items()}, base / "model.safetensors",
              metadata={"format": "pt"})
    refused = launched("resume", run)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "error: 2 of 2 processes failed (rank 0: exit 2, rank 1: exit 2)" in refused.stderr
    assert refused.stderr.count("model.safetensors changed") == 1, refused.stderr[-3000:]  # said by the launcher
    assert "Traceback" not in refused.stderr


def test_bad_input_every_process_refuses_is_said_once_by_the_launcher(recipe, tmp_path):
    """Each process refuses the recipe (before any process group): the launcher says the error once, above its
    summary line, not once per process."""
    bad = launched("train", recipe, "--output-dir", tmp_path / "run", "--set", "training.learning_rate=-1")
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-3000:]
    said = "'training.learning_rate' = -1: Input should be greater than 0"
    assert (bad.stdout + bad.stderr).count(said) == 1, bad.stderr[-3000:]
    lines = bad.stderr.splitlines()
    summary = next(n for n, line in enumerate(lines) if line.startswith("error: 2 of 2 processes failed ("))
    assert "exit 2" in lines[summary] and lines[:summary].count("error: invalid recipe:") == 1, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_one_launch_exits_75_when_every_process_stopped_and_resumes_exactly(recipe, straight, tmp_path):
    """torchrun exits 1 (and prints a ChildFailedError traceback) when its processes stop with exit 75, so a
    script that requeues on 75 never requeued: `--nproc-per-node` keeps gpupoor's codes. The stop: rank 1 alone
    finds its time limit reached after step 3 (each process measures its own), and every process stops there."""
    run = tmp_path / "run"
    stopped = launched("train", recipe, "--output-dir", run, "--set", "distributed.strategy=ddp",
                       fault="rank1/timeout@3")
    assert stopped.returncode == 75, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    stopped_by_rank1_at_step_3(stopped, run, "time limit 1h nearly reached")
    assert "Traceback" not in stopped.stderr and "ChildFailedError" not in stopped.stderr, stopped.stderr[-3000:]
    resumed = launched("resume", run)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "processes: 2 (DDP, gloo" in resumed.stdout
    assert losses(run) == losses(straight("ddp"))
    a, b = adapter(straight("ddp")), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    bad = launched("resume", run, "--set", "training.learning_rate=0.5")  # refused by every process: exit 2
    assert bad.returncode == 2 and "training.learning_rate" in bad.stdout + bad.stderr, \
        (bad.returncode, bad.stdout[-2000:], bad.stderr[-3000:])
    # (either process may be stopped by the launcher before it says so itself: a 2 anywhere is exit 2; which one
    # exits first is a race, so the line is checked for a 2 without naming the rank)
    summary = next(line for line in bad.stderr.splitlines() if line.startswith("error: 2 of 2 processes failed ("))
    assert "exit 2" in summary, summary
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_a_signal_to_the_launcher_stops_every_process_with_a_checkpoint(recipe, tmp_path):
    """A scheduler signals the one process it started (SLURM's --signal, a batch script's `kill`); its processes
    run in sessions of their own, so it passes the signal on and waits for their checkpoint: exit 75."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gpupoor", "train", recipe, "--output-dir", run, "--nproc-per-node", "2",
               "--set", "training.max_steps=100000", "--set", "checkpoint.every_steps=null"]
    stopped = signalled_once(command, lambda: has_a_step(run), signal.SIGTERM, {"GPUPOOR_FAULT": ""}, poll_s=0.5)
    out, err = stopped.stdout, stopped.stderr
    assert stopped.returncode == 75, out[-2000:] + err[-3000:]
    step = max(r["step"] for r in read_metrics(run) if "loss" in r)
    assert f"stopped after step {step} with checkpoint checkpoints/step-{step:06d}" in out
    assert (run / "checkpoints" / f"step-{step:06d}" / "manifest.json").is_file()
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_full_disk_on_one_process_stops_every_process_with_one_line(recipe, tmp_path, strategy):
    """The disk fills for rank 1 alone in the middle of step 4's save (under FSDP inside DCP's write of its
    optimizer shard). Every process learns of it in one collective: each exits 1 with the same one-line error
    naming the checkpoint, what it needs and what is free; no traceback, no process dies in gloo; the staging
    directory is gone and the previous checkpoint is intact."""
    from gpupoor.storage.checkpoint import verify

    run = tmp_path / "run"
    failed = torchrun("train", recipe, "--output-dir", run, "--set", f"distributed.strategy={strategy}",
                      fault="rank1/enospc@gathered:4")
    assert exit_codes(failed) == [1, 1], failed.stderr[-4000:]
    line = f"error: disk full while writing checkpoint step-000004: it needs about "
    assert failed.stderr.count(line) == 2, failed.stderr[-4000:]
    assert f"on {run / 'checkpoints'} (" in failed.stderr and " MiB free)" in failed.stderr
    assert failed.stderr.count(f"free some space, then continue with: gpupoor resume {run}") == 2
    # torchrun's own report is the only traceback: none from gpupoor's processes (DCP's CheckpointException
    # is a BaseException), none from gloo
    assert "/gpupoor/" not in failed.stderr and "CheckpointException" not in failed.stderr
    assert "Connection closed" not in failed.stderr and "OSError" not in failed.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    assert verify(run / "checkpoints" / "step-000002") is None


@pytest.mark.slow
def test_a_full_disk_while_writing_final_stops_every_process_with_one_line(straight, tmp_path):
    """final/ is written by the first process alone: the others learn that it failed instead of waiting for it
    in the last barrier (and dying in gloo, or of the launcher's SIGTERM)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight("ddp"), run)
    shutil.rmtree(run / "final")  # the last checkpoint is there: the resume only writes final/
    failed = torchrun("resume", run, fault="enospc@start:4")
    assert exit_codes(failed) == [1, 1], failed.stderr[-4000:]
    assert failed.stderr.count(f"error: disk full while writing checkpoint final: it needs about ") == 2
    assert f"on {run} (" in failed.stderr and "/gpupoor/" not in failed.stderr
    assert not (run / "final").exists() and not [p for p in run.iterdir() if p.name.startswith(".tmp")]


def _rewrite(checkpoint: Path, name: str, content: bytes) -> None:
    """Replace a checkpoint's file and its manifest entry alike: the hashes match, only the content is wrong."""
    import hashlib

    (checkpoint / name).write_bytes(content)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class _Hostile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tampered_metadata(straight, tmp_path: Path, content: str) -> tuple[Path, Path]:
    """A copy of the FSDP straight run, unfinished, whose newest checkpoint's DCP .metadata is replaced (its
    manifest rewritten to match) by `content`: one that would run code (touching the marker), a truncated one,
    or one that is not DCP's Metadata. The run and the marker."""
    import pickle
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight("fsdp"), run)
    shutil.rmtree(run / "final")  # unfinished: resume continues from the newest valid checkpoint
    newest, marker = run / "checkpoints" / "step-000004", tmp_path / "code-ran"
    metadata = (newest / "optimizer" / ".metadata").read_bytes()
    _rewrite(newest, "optimizer/.metadata", {"hostile": pickle.dumps(_Hostile(marker)), "truncated": metadata[:40],
                                             "not-metadata": pickle.dumps(torch.Size([3]))}[content])
    return run, marker


@pytest.mark.slow
@pytest.mark.parametrize("content", ["hostile", "truncated", "not-metadata"])
def test_a_refused_optimizer_metadata_makes_its_checkpoint_invalid(straight, tmp_path, content):
    """DCP's .metadata is a pickle: each kind of bad one makes its checkpoint invalid like a corrupt file, even
    with a manifest rewritten to match, and no code runs. (The check a resume makes of each checkpoint, run here
    in this process: what a resume then does with an invalid checkpoint is the same for each kind, and the test
    below resumes from one under FSDP.)"""
    from gpupoor.train.distributed import optimizer_problem

    run, marker = tampered_metadata(straight, tmp_path, content)
    problem = optimizer_problem(run / "checkpoints" / "step-000004")
    assert problem and problem.startswith("optimizer/.metadata is refused ("), problem
    assert not marker.exists()
    assert optimizer_problem(run / "checkpoints" / "step-000002") is None


@pytest.mark.slow
def test_a_refused_optimizer_metadata_falls_back_to_the_previous_checkpoint(straight, tmp_path):
    """One that would run code: resume warns, resumes from the previous checkpoint (no code ran, no traceback) and
    ends where the straight run ended."""
    run, marker = tampered_metadata(straight, tmp_path, "hostile")
    resumed = torchrun("resume", run)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "warning: skipping checkpoint step-000004: optimizer/.metadata is refused (" in resumed.stdout
    assert "resuming from step-000002" in resumed.stdout
    assert not marker.exists() and "Traceback" not in resumed.stderr
    a, b = adapter(straight("fsdp")), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one", "ddp"])
def test_a_whole_optimizer_pt_resumes_under_fsdp_with_force(recipe, straight, tmp_path, monkeypatch, layout):
    """A checkpoint of one process (or DDP) holds the whole optimizer.pt: resumed on two FSDP processes with
    --force, it is sharded into them with every hyperparameter (LambdaLR's initial_lr included), and the run ends
    where the run that never stopped ends; AdamW's step count carried over."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = tmp_path / "run"
    if layout == "one":  # accumulating two micro-batches: two processes with one each take the same ones
        stopped = invoke("train", recipe, "--output-dir", run, "--set", "training.gradient_accumulation_steps=2",
                         *FSDP, fault="sigterm@2", monkeypatch=monkeypatch)  # (in this process: no start-up)
        assert stopped.exit_code == 75, stopped.output[-2000:]
        changes = ["--set", "training.gradient_accumulation_steps=1"]
    else:
        stopped = torchrun("train", recipe, "--output-dir", run, "--set", "distributed.strategy=ddp",
                           fault="sigterm@2", env_extra=aborting_teardown(tmp_path))
        assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]  # (no process reached the teardown)
        changes = FSDP
    assert (run / "checkpoints" / "step-000002" / "optimizer.pt").is_file()
    resumed = torchrun("resume", run, "--force", *changes)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "FSDP, gloo" in resumed.stdout
    reference = straight(layout)
    for (step, loss, eval_loss), (step_b, loss_b, eval_b) in zip(losses(reference), losses(run), strict=True):
        assert step == step_b
        assert loss == pytest.approx(loss_b, rel=1e-5) if loss is not None else loss_b is None
        assert eval_loss == pytest.approx(eval_b, rel=1e-5) if eval_loss is not None else eval_b is None
    assert close(adapter(reference), adapter(run))
    dcp_to_torch_save(run / "checkpoints" / "step-000004" / "optimizer", tmp_path / "optimizer.pt")
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)["state"]
    assert state and all(int(values["step"]) == 4 for values in state.values())


def weights(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of final/: the adapter, or a full fine-tune's model shards."""
    found = {}
    for file in sorted((run / "final").glob("*.safetensors")):
        found.update(load_file(file))
    return found


FSDP_METHODS = {  # LoRA itself runs in the tests above
    "full": {"peft": {"method": "full"}},
    "dora-last-layer": {"peft": {"method": "dora", "rank": 4, "last_layers": 1}},
    "ia3": {"peft": {"method": "ia3"}},
    "qlora-4bit-checkpointing-distill": {"quantization": {"bits": 4}, "memory": {"gradient_checkpointing": True},
                                         "distill": "teacher"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FSDP_METHODS)
def test_every_method_trains_and_resumes_under_fsdp(make_recipe, tiny_tied_model, tmp_path, monkeypatch, name):
    """Each method under FSDP x 2, stopped by a signal to rank 1 at step 2 and resumed, ends where one process
    accumulating two micro-batches ends: sharding, the gathered checkpoint and the resharded optimizer state are
    all right (a lost optimizer state or a wrongly mapped weight moves the result far beyond rounding)."""
    sections = dict(FSDP_METHODS[name])
    if sections.get("distill") == "teacher":
        sections["distill"] = {"teacher": str(tiny_tied_model), "weight": 0.5}
    recipe = make_recipe(training={"max_steps": 4, "micro_batch_size": 2}, **sections)
    # The one-process reference trains in this process (the integration tier's way): a process of its own would
    # only add the ~10 s every Python start spends importing torch, transformers and peft.
    one = invoke("train", recipe, "--output-dir", tmp_path / "one", "--set", "training.gradient_accumulation_steps=2",
                 monkeypatch=monkeypatch)
    assert one.exit_code == 0, one.output[-2000:]
    stopped = torchrun("train", recipe, "--output-dir", tmp_path / "fsdp", *FSDP, fault="rank1/sigterm@2")
    assert exit_codes(stopped) == [75, 75], stopped.stdout[-2000:] + stopped.stderr[-3000:]
    resumed = torchrun("resume", tmp_path / "fsdp")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    reference = [loss for _, loss, _ in losses(tmp_path / "one")]
    assert [loss for _, loss, _ in losses(tmp_path / "fsdp")] == pytest.approx(reference, rel=1e-5)
    assert close(weights(tmp_path / "one"), weights(tmp_path / "fsdp"))


@pytest.mark.slow
def test_an_fsdp_stop_before_the_first_step_resumes_exactly(recipe, straight, tmp_path):
    """A checkpoint at step 0 holds no optimizer state yet; creating one for it (DCP's loader would, with a step
    of its own) would make the resumed run differ."""
    run = tmp_path / "run"
    stopped = torchrun("train", recipe, "--output-dir", run, *FSDP, fault="sigterm@startup")
    assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]
    assert (run / "checkpoints" / "step-000000" / "manifest.json").is_file()
    resumed = torchrun("resume", run)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert losses(run) == losses(straight("fsdp"))
    a, b = adapter(straight("fsdp")), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_on_two_processes_trains_like_one_process_accumulating(straight, strategy):
    """precision bf16 on the CPU (#42): two processes (DDP; FSDP, which gathers the fp32 LoRA weights in bf16 where
    one process casts them under autocast) end where one process accumulating their two micro-batches ends. Both
    multiply the same bf16 values and add the two gradients in fp32 (commutative for two): measured bitwise here.
    Bounds: bf16's tolerances of tests/integration/test_cpu_bf16.py (the losses U / 8, the adapter 8 U)."""
    from support.cpu_bf16 import GRAD_REL, LOSS_REL

    changes = ("--set", "precision=bf16", "--set", "training.max_steps=2")
    one, two = straight("one", *changes), straight(strategy, *changes)
    assert len([loss for _, loss, _ in losses(one) if loss is not None]) == 2
    for (step, loss, eval_loss), (step_b, loss_b, eval_b) in zip(losses(one), losses(two), strict=True):
        assert step == step_b
        assert loss == pytest.approx(loss_b, rel=LOSS_REL) if loss is not None else loss_b is None
        assert eval_loss == pytest.approx(eval_b, rel=LOSS_REL) if eval_loss is not None else eval_b is None
    assert close(adapter(one), adapter(two), GRAD_REL)
