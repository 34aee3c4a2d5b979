"""The integration tier of test_distributed.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from support.cli import invoke
from support.runs import read_metrics

from support.distributed import recipe


def test_launch_exit_codes_and_options_without_nproc_per_node(make_recipe):
    from gpupoor.run.launch import exit_code

    assert [exit_code(codes) for codes in ([0, 0], [75, 75], [75, 2], [130, 130], [75, 0], [75, -9], [1, 0])] == \
        [0, 75, 2, 130, 1, 1, 1]
    result = invoke("train", make_recipe(), "--nnodes", "2", "--master-port", "29511")
    assert result.exit_code == 2, result.output
    assert "--nnodes, --master-port without --nproc-per-node" in result.output


def test_the_launcher_refuses_a_torch_too_old_for_it(make_recipe, monkeypatch):
    from gpupoor.run.launch import _version

    assert [_version(v) for v in ("2.13.0+cpu", "2.9.0", "2.8.1", "3.0.0a0", "2.10.0.dev20250101")] == \
        [(2, 13), (2, 9), (2, 8), (3, 0), (2, 10)]
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    result = invoke("train", make_recipe(), "--nproc-per-node", "2")
    assert result.exit_code == 2, result.output
    assert "--nproc-per-node needs torch 2.9 or newer (this is 2.8.0)" in result.output


def test_resume_if_present_trains_then_resumes_then_says_done(make_recipe, tmp_path, monkeypatch):
    """The same command line, repeated by a requeued batch job."""
    recipe = make_recipe(training={"max_steps": 4})
    command = ("train", recipe, "--output-dir", tmp_path / "run", "--resume-if-present")
    first = invoke(*command, monkeypatch=monkeypatch, fault="sigterm@2")
    assert first.exit_code == 75, first.output
    again = invoke(*command, monkeypatch=monkeypatch)
    assert again.exit_code == 0, again.output
    assert "resuming from step-000002" in again.output
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]
    done = invoke(*command, monkeypatch=monkeypatch)
    assert done.exit_code == 0 and "already finished at step 4" in done.output
    # An edited recipe that would change the trajectory is refused, not silently mixed into the run.
    changed = invoke(*command, "--set", "training.learning_rate=0.5", monkeypatch=monkeypatch)
    assert changed.exit_code == 2 and "training.learning_rate" in changed.output
    # Without the flag an existing run is never trained over.
    refused = invoke("train", recipe, "--output-dir", tmp_path / "run", monkeypatch=monkeypatch)
    assert refused.exit_code == 2


@pytest.mark.parametrize("variable, named", [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                                             ("ACCELERATE_USE_FSDP", "accelerate's FSDP")])
def test_launches_gpupoor_cannot_train_under_are_refused_before_loading(make_recipe, monkeypatch, tmp_path,
                                                                        variable, named):
    monkeypatch.setenv(variable, "true")
    result = invoke("train", make_recipe(), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and named in result.output and "distributed.strategy" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fault, code", [("", 0), ("sigterm@2", 75)])
def test_a_run_destroys_the_process_group_before_the_process_exits(make_recipe, tmp_path, monkeypatch, fault, code):
    """Left to interpreter shutdown, gloo's process group can abort a process that trained fine (SIGABRT,
    "terminate called without an active exception"; seen once in CI after a two-process DPO run). A finished or
    stopped run destroys it while the interpreter is whole. In-process, with a one-process group standing in."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        result = invoke("train", make_recipe(training={"max_steps": 3}), "--output-dir", tmp_path / "run",
                        monkeypatch=monkeypatch, fault=fault)
        assert result.exit_code == code, result.output
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
