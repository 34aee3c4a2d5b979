"""`gpupoor export` of trained runs: the adapter merged once, several files from that merge, the f32 file the very
model merge-lora writes, and the quality table measured on the run's own eval set."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch

from support.cli import invoke, run_cli
from support.recipes import write_recipe
from support.rows import alpaca_rows, write_jsonl

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("export")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(48))
    recipe = write_recipe(root / "recipe.yaml", tiny_model, data, data={"eval_rows": 8},
                          training={"max_steps": 6, "learning_rate": 2e-2})
    result = invoke("train", recipe, "--output-dir", root / "run")
    assert result.exit_code == 0, result.output
    return root / "run"


def test_one_merge_writes_each_file_and_measures_it_on_the_runs_eval_set(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from gpupoor.export.gguf.read_back import load_gguf_back

    result = invoke("export", lora_run, "-q", "f32", "-q", "q8_0", "-q", "q4_k_m")
    assert result.exit_code == 0, result.output
    assert result.output.count("merging the adapter") == 1
    folder = lora_run / "gguf"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"run-{q}.{ext}" for q in ("f32", "q8_0", "q4_k_m") for ext in ("gguf", "Modelfile")] + ["run.quality.json"])
    assert not list(folder.glob(".*")), "the merge's scratch directory is removed"
    modelfile = (folder / "run-q8_0.Modelfile").read_text()  # an alpaca run: Alpaca's prompt, not a chat template
    assert "### Instruction:\n{{ .Prompt }}\n\n### Response:\n{{ .Response }}" in modelfile
    report = json.loads((folder / "run.quality.json").read_text())
    assert report["eval"]["source"] == "the run's eval set" and report["eval"]["computed_in"] == "fp32"
    rows = {row["type"]: row for row in report["rows"]}
    assert rows["f32"]["perplexity"] == rows["full precision"]["perplexity"]
    assert abs(rows["q8_0"]["change_pct"]) < 1.0
    # The f32 file is the model merge-lora writes (fp32), bit for bit.
    assert invoke("merge-lora", lora_run, "--output", tmp_path / "merged", "--dtype", "fp32").exit_code == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7, 11, 90]])
    with torch.no_grad():
        assert torch.equal(load_gguf_back(folder / "run-f32.gguf", tmp_path / "merged")(ids).logits,
                           merged(ids).logits)


def test_a_second_export_to_the_same_names_is_refused_and_keeps_the_first(lora_run):
    first = (lora_run / "gguf" / "run-q8_0.gguf").read_bytes() if (lora_run / "gguf").exists() else None
    if first is None:
        assert invoke("export", lora_run, "-q", "q8_0", "--no-quality").exit_code == 0
        first = (lora_run / "gguf" / "run-q8_0.gguf").read_bytes()
    result = invoke("export", lora_run, "-q", "q8_0", "--no-quality")
    assert result.exit_code == 2 and "already exists" in result.output
    assert (lora_run / "gguf" / "run-q8_0.gguf").read_bytes() == first


def test_a_run_on_a_quantized_gguf_base_is_warned_about_the_bases_grid(tmp_path, tiny_model):
    """The base is a Q8_0 file gpupoor itself exported: training reads it (dequantized), and exporting the run
    says that its weights sit on that grid, and which requested type is that very grid."""
    from gpupoor.export.gguf.file import write_gguf
    from gpupoor.export.gguf.quant_names import QUANTS

    base = tmp_path / "base-q8_0.gguf"
    write_gguf(tiny_model, base, QUANTS["q8_0"], name="tiny base")
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(16))
    recipe = write_recipe(tmp_path / "recipe.yaml", base, data, training={"max_steps": 2})
    assert invoke("train", recipe, "--output-dir", tmp_path / "run").exit_code == 0
    result = invoke("export", tmp_path / "run", "-q", "f16", "-q", "q8_0", "--no-quality")
    assert result.exit_code == 0, result.output
    assert result.output.count("note: the base base-q8_0.gguf is Q8_0: --quant q8_0 rounds") == 1
    assert "--quant f16 rounds" not in result.output
    assert "note: the base base-q8_0.gguf is quantized (Q8_0)" in result.output
    assert (tmp_path / "run" / "gguf" / "run-q8_0.gguf").is_file()


def test_a_qlora_run_exports_the_model_it_trained(tmp_path, tiny_model):
    """QLoRA: the adapter is merged into the base as the run saw it (4-bit, dequantized), as merge-lora does."""
    from transformers import AutoModelForCausalLM

    from gpupoor.export.gguf.read_back import load_gguf_back

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(16))
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_model, data, training={"max_steps": 2},
                          quantization={"bits": 4})
    assert invoke("train", recipe, "--output-dir", tmp_path / "run").exit_code == 0
    result = invoke("export", tmp_path / "run", "-q", "f32", "--no-quality")
    assert result.exit_code == 0, result.output
    assert "QLoRA run: merging into the base as the run saw it" in result.output
    # export has no --qlora-base: the way to the full-precision base is merge-lora's option, then export
    assert "instead: gpupoor merge-lora RUN --qlora-base original --output DIR, then gpupoor export DIR" \
        in result.output
    assert invoke("merge-lora", tmp_path / "run", "--output", tmp_path / "merged", "--dtype", "fp32").exit_code == 0
    ids = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7, 11, 90]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(load_gguf_back(tmp_path / "run" / "gguf" / "run-f32.gguf", tmp_path / "merged")(ids).logits,
                           merged(ids).logits)


def test_sigterm_mid_export_removes_the_merge_and_the_partial_file_and_says_what_is_complete(lora_run, tmp_path,
                                                                                            monkeypatch):
    """SIGTERM while the second file is half written (the fp32 merge beside it): both are removed as for Ctrl-C,
    the complete file is named and kept, and the exit code is the shell's for SIGTERM."""
    out = tmp_path / "out"
    received = []  # the test process's own handler: without export's, the injected SIGTERM must not end pytest
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        result = invoke("export", lora_run, "-q", "f32", "-q", "q8_0", "--output", out / "m.gguf", "--no-quality",
                        monkeypatch=monkeypatch, fault="sigterm@gguf-tensor:q8_0")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 143, result.output
    assert f"stopped by SIGTERM: complete and kept: {out / 'm-f32.gguf'}; what was half written was removed" \
        in result.output
    assert sorted(p.name for p in out.iterdir()) == ["m-f32.gguf"] and not received


def test_what_a_killed_export_left_is_removed_by_the_next_export(lora_run, tmp_path):
    """SIGKILL leaves the fp32 merge and the partial file under temporary names that carry the pid: the next
    export into the folder removes them (their process is gone) and says so."""
    out = tmp_path / "out"
    killed = run_cli(["export", lora_run, "-q", "q8_0", "--output", out / "m.gguf", "--no-quality"],
                     {"GPUPOOR_FAULT": "kill@gguf-tensor:q8_0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = sorted(p.name for p in out.iterdir())
    assert any(name.startswith(".gpupoor-export-") for name in left), left
    assert any(name.startswith(".m.gguf.tmp-") for name in left), left
    result = invoke("export", lora_run, "-q", "q8_0", "--output", out / "m.gguf", "--no-quality")
    assert result.exit_code == 0, result.output
    assert result.output.count("left by an export that was killed") == 2, result.output
    assert sorted(p.name for p in out.iterdir()) == ["m.Modelfile", "m.gguf"]


def test_a_disk_without_room_for_the_fp32_merge_is_refused_before_any_work(lora_run, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    out = tmp_path / "out"
    result = invoke("export", lora_run, "-q", "q4_0", "--output", out / "m.gguf", "--no-quality")
    assert result.exit_code == 2, result.output
    assert "not enough free space: the export writes about" in result.output
    assert f"for the fp32 merge in {out} and" in result.output and "--work-dir DIR" in result.output
    assert "merging" not in result.output and not out.exists()


def test_a_disk_that_fills_during_the_merge_is_said_with_the_space_it_needs(lora_run, tmp_path, monkeypatch):
    """safetensors says a full disk as a SafetensorError with Rust's "os error 28" and no errno: it is still a full
    disk, said with where (the --work-dir the merge goes to) and how much, with nothing left there."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()  # --work-dir must exist: a mistyped one is refused rather than created
    result = invoke("export", lora_run, "-q", "q8_0", "--output", out / "m.gguf", "--work-dir", work, "--no-quality")
    assert result.exit_code == 2, result.output
    assert f"the disk filled while writing {work}: the export needs about" in result.output
    assert f"for the fp32 merge in {work} and" in result.output and "--work-dir DIR" in result.output
    assert not out.exists() and list(work.iterdir()) == []


def test_what_a_killed_merge_left_beside_its_output_is_removed_by_the_next_merge(lora_run, tmp_path):
    """merge-lora's partial output (.tmp-NAME-PID@HOST) and a GGUF base's dequantized copy (.tmp-gguf-base-PID@HOST-*)
    of a process of this host that is gone are removed; those of a running process, of another host (a job on
    another node sharing the folder: its pid means nothing here) or with no real pid are left alone, and named."""
    import subprocess
    import sys

    from gpupoor.storage.files import _host

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    here = _host()
    removed = [f".tmp-merged-{dead}@{here}", f".tmp-gguf-base-{dead}@{here}-x1y2"]
    kept = [f".tmp-merged-1@{here}", f".tmp-merged-{dead}@other-node-7", f".tmp-merged-99999999999@{here}"]
    for name in removed + kept:  # pid 1 runs; a pid past pid_max is none of this machine's
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    result = invoke("merge-lora", lora_run, "--output", tmp_path / "merged")
    assert result.exit_code == 0, result.output
    assert result.output.count("left by a merge that was killed") == 2, result.output
    assert "written on host other-node-7" in result.output and result.output.count("left alone") == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(kept)


def test_an_eval_text_too_short_to_score_is_refused_before_the_merge(lora_run, tmp_path):
    """It was found after the GGUF and its Modelfile were written, and both were left; the tokenizer is the run's,
    loaded before any work."""
    (tmp_path / "short.txt").write_text("a")
    out = tmp_path / "out"
    result = invoke("export", lora_run, "-q", "q8_0", "--output", out / "m.gguf", "--eval", tmp_path / "short.txt")
    assert result.exit_code == 2, result.output
    assert "short.txt: fewer than two tokens of text to score" in result.output
    assert "merging" not in result.output and not out.exists()
