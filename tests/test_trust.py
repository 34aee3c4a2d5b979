"""Nothing read back is trusted unverified; resume keeps its promises in the cases users hit (issue #12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import read_metrics
from gpupoor.cli import app
from gpupoor.optim import lr_factor

runner = CliRunner()


def invoke(*args, monkeypatch=None, fault: str | None = None):
    if monkeypatch is not None:
        if fault:
            monkeypatch.setenv("GPUPOOR_FAULT", fault)
        else:
            monkeypatch.delenv("GPUPOOR_FAULT", raising=False)
    return runner.invoke(app, [str(a) for a in args])


def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def adapter(run: Path) -> dict[str, torch.Tensor]:
    # Copies: the loaded tensors may map the file, which the tests then change.
    return {k: v.clone() for k, v in load_file(run / "final" / "adapter_model.safetensors").items()}


@pytest.fixture()
def finished_run(make_recipe, tmp_path):
    recipe = make_recipe("trust.yaml")
    run = tmp_path / "run"
    result = invoke("train", recipe, "--output-dir", run)
    assert result.exit_code == 0, result.output
    return run


# ---------------------------------------------------------------------------------------------------------------
# final/ and checkpoints are verified by every reader


def test_every_reader_refuses_a_flipped_bit_in_final(finished_run, tmp_path):
    flip_byte(finished_run / "final" / "adapter_model.safetensors", 0.9)  # inside the tensor data
    merged = invoke("merge-lora", finished_run, "--output", tmp_path / "merged")
    assert merged.exit_code == 2, merged.output
    assert "adapter_model.safetensors is corrupt" in merged.output and not (tmp_path / "merged").exists()
    generated = invoke("generate", finished_run, "--prompt", "hello", "--max-new-tokens", "2")
    assert generated.exit_code == 2 and "adapter_model.safetensors is corrupt" in generated.output
    status = invoke("status", finished_run)
    assert status.exit_code == 2 and "final/ INVALID" in status.output and "finished:" not in status.output
    # The user who edited the file on purpose can still merge it.
    forced = invoke("merge-lora", finished_run, "--output", tmp_path / "forced", "--skip-manifest-check")
    assert forced.exit_code == 0, forced.output


def test_resume_writes_a_corrupt_final_again_from_the_last_checkpoint(finished_run):
    reference = adapter(finished_run)
    flip_byte(finished_run / "final" / "adapter_model.safetensors", 0.9)
    result = invoke("resume", finished_run)
    assert result.exit_code == 0, result.output
    assert "final/ is not valid" in result.output
    restored = adapter(finished_run)
    assert restored.keys() == reference.keys() and all(torch.equal(restored[k], reference[k]) for k in reference)
    assert invoke("status", finished_run).exit_code == 0
    steps = [r["step"] for r in read_metrics(finished_run) if "loss" in r]
    assert steps == [1, 2, 3, 4]  # nothing trained or logged twice


def test_a_manifest_that_lists_no_files_is_not_a_valid_checkpoint(make_recipe, tmp_path, monkeypatch):
    recipe = make_recipe("m.yaml", training={"max_steps": 6}, checkpoint={"every_steps": 2})
    run = tmp_path / "run"
    assert invoke("train", recipe, "--output-dir", run, monkeypatch=monkeypatch, fault="sigterm@5").exit_code == 75
    newest = run / "checkpoints" / "step-000005" / "manifest.json"
    manifest = json.loads(newest.read_text())
    newest.write_text(json.dumps({**manifest, "files": {}}))
    status = invoke("status", run)
    assert status.exit_code == 0, status.output
    assert "step-000005  INVALID: its manifest does not list adapter_model.safetensors" in status.output
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert "skipping checkpoint step-000005" in result.output and "resuming from step-000004" in result.output


def test_status_of_a_manifest_without_created_time(finished_run, make_recipe, tmp_path):
    checkpoint = next((finished_run / "checkpoints").iterdir())
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["created"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("status", finished_run)
    assert result.exit_code == 0 and f"{checkpoint.name}  step 4" in result.output and "age -" in result.output


# ---------------------------------------------------------------------------------------------------------------
# The tokenized-data cache is checked before it is used


def _cache_entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "tokenized").glob("*.safetensors"))


@pytest.mark.parametrize("damage", ["bitflip", "empty"])
def test_a_damaged_cache_entry_is_a_miss_with_a_warning(make_recipe, tmp_path, damage):
    recipe = make_recipe("cache.yaml")
    first = invoke("train", recipe, "--output-dir", tmp_path / "first")
    assert first.exit_code == 0, first.output
    [entry] = _cache_entries(tmp_path)
    if damage == "bitflip":
        flip_byte(entry, 0.95)  # in the token ids, past the header: still a readable safetensors file
    else:
        entry.write_bytes(b"")  # what a power cut after the rename of an unsynced file leaves
    second = invoke("train", recipe, "--output-dir", tmp_path / "second")
    assert second.exit_code == 0, second.output
    assert "tokenized cache entry" in second.output and "is invalid" in second.output
    assert "tokenized cache hit" not in second.output
    a, b = adapter(tmp_path / "first"), adapter(tmp_path / "second")
    assert all(torch.equal(a[k], b[k]) for k in a)
    third = invoke("train", recipe, "--output-dir", tmp_path / "third")  # the entry was written again
    assert "tokenized cache hit" in third.output and "invalid" not in third.output
    assert not [p for p in entry.parent.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------------------------
# Resume semantics


def test_an_eval_lost_to_a_crash_after_its_checkpoint_is_run_again(make_recipe, tmp_path, monkeypatch):
    sections = {"training": {"max_steps": 6, "eval_every_steps": 2}, "data": {"eval_rows": 8},
                "checkpoint": {"every_steps": 2}}
    straight = tmp_path / "straight"
    assert invoke("train", make_recipe("s.yaml", **sections), "--output-dir", straight,
                  monkeypatch=monkeypatch).exit_code == 0
    run = tmp_path / "crashed"
    # SIGKILL right after checkpoint step-4 is committed (the rotate stage), before the eval of step 4 is written.
    env = {**os.environ, "GPUPOOR_FAULT": "kill@rotate:4"}
    crashed = subprocess.run([sys.executable, "-m", "gpupoor", "train", str(make_recipe("c.yaml", **sections)),
                              "--output-dir", str(run)], env=env, capture_output=True, text=True)
    assert crashed.returncode == -9, crashed.stderr
    assert [r["step"] for r in read_metrics(run) if "eval_loss" in r] == [2]
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(run) if "eval_loss" in r]
    assert evals == [(r["step"], r["eval_loss"]) for r in read_metrics(straight) if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 4, 6]


def test_extending_a_finished_run_follows_the_new_schedule_without_new_warmup(make_recipe, tmp_path):
    recipe = make_recipe("lr.yaml", training={"max_steps": 8, "warmup_steps": None, "warmup_ratio": 0.25})
    run = tmp_path / "run"
    assert invoke("train", recipe, "--output-dir", run).exit_code == 0
    result = invoke("resume", run, "--set", "training.max_steps=20")
    assert result.exit_code == 0, result.output
    lrs = {r["step"]: r["lr"] for r in read_metrics(run) if "loss" in r}
    assert sorted(lrs) == list(range(1, 21))
    peak, warmup = 1e-2, 2  # warmup of the first run: ceil(0.25 * 8); the extension does not warm up again
    for step in range(1, 9):  # as trained
        assert lrs[step] == pytest.approx(peak * lr_factor(step - 1, warmup, 8, "cosine"), rel=1e-12), step
    for step in range(9, 21):  # every resumed step takes the new schedule's value at that step
        assert lrs[step] == pytest.approx(peak * lr_factor(step - 1, warmup, 20, "cosine"), rel=1e-12), step
    assert lrs[9] > 0.0
