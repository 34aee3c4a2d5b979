"""`dequantized_copy` (gpupoor/model/pretrained.py): the real GGUF's fp32 transformers directory is read back
only when it is whole, and rebuilt when its stamp or a file was tampered with. Never on the real cache: each test
links the verified GGUF and the cached copy's files into tmp_path and tampers there (a tampered file is a new
file in place of its link, never a write through it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpupoor.model.pretrained import DEQUANTIZED_STAMP, dequantized_copy
from gpupoor.storage.files import sha256_file


def linked_copy(real_gguf: Path, real_model_dir: Path, folder: Path) -> tuple[Path, Path]:
    """The GGUF and its whole dequantized copy in `folder`, as links to the verified cache."""
    gguf = folder / real_gguf.name
    gguf.symlink_to(real_gguf)
    copy = folder / real_model_dir.name
    copy.mkdir()
    for path in real_model_dir.iterdir():
        (copy / path.name).symlink_to(path)
    return gguf, copy


def replace(path: Path, content: bytes) -> None:
    path.unlink()  # the link, not the cached file it points to
    path.write_bytes(content)


TAMPERINGS = {
    "the stamp names another GGUF": lambda copy: replace(copy / DEQUANTIZED_STAMP, json.dumps(
        {**json.loads((copy / DEQUANTIZED_STAMP).read_text()), "gguf_sha256": "0" * 64}).encode()),
    "a listed file's bytes changed": lambda copy: replace(copy / "config.json",
                                                          (copy / "config.json").read_bytes() + b" "),
    "a listed file is missing": lambda copy: (copy / "tokenizer.json").unlink(),
    "the stamp is cut short": lambda copy: replace(copy / DEQUANTIZED_STAMP,
                                                   (copy / DEQUANTIZED_STAMP).read_bytes()[:40]),
}


def test_a_whole_copy_is_read_back_without_rebuilding(real_gguf, real_model_dir, tmp_path, monkeypatch):
    gguf, copy = linked_copy(real_gguf, real_model_dir, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a whole copy was rebuilt")

    monkeypatch.setattr("gpupoor.model.load.save_dequantized", refuse)
    assert dequantized_copy(gguf) == copy
    assert all(path.is_symlink() for path in copy.iterdir())


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_a_tampered_copy_is_rebuilt(real_gguf, real_model_dir, tmp_path, monkeypatch, tampering):
    gguf, copy = linked_copy(real_gguf, real_model_dir, tmp_path)
    TAMPERINGS[tampering](copy)
    rebuilt = []

    def rebuild(location, target, dtype):  # what a rebuild writes is checked by the test below; here, that it runs
        rebuilt.append(location)
        (target / "config.json").write_text("rebuilt")
        return target

    monkeypatch.setattr("gpupoor.model.load.save_dequantized", rebuild)
    assert dequantized_copy(gguf) == copy and rebuilt == [str(gguf)]
    assert sorted(path.name for path in copy.iterdir()) == ["config.json", DEQUANTIZED_STAMP]
    stamp = json.loads((copy / DEQUANTIZED_STAMP).read_text())
    assert stamp["files"] == {"config.json": sha256_file(copy / "config.json")}
    assert dequantized_copy(gguf) == copy and rebuilt == [str(gguf)]  # now whole: read back, not rebuilt again


def test_a_rebuild_dequantizes_the_gguf_again_bitwise(real_gguf, real_model_dir, tmp_path):
    """One real rebuild (half a minute): the weights it writes are the cached copy's, byte for byte, and the real
    cache is untouched; and they are SmolLM2-135M-Instruct's, correctly dequantized: the model knows a fact. (The
    one test that dequantizes the GGUF in-process; test_gguf_real.py trains from it.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, copy = linked_copy(real_gguf, real_model_dir, tmp_path)
    replace(copy / "model.safetensors", b"not the weights")
    assert dequantized_copy(gguf) == copy
    assert not any(path.is_symlink() for path in copy.iterdir())
    stamp = json.loads((copy / DEQUANTIZED_STAMP).read_text())
    cached = json.loads((real_model_dir / DEQUANTIZED_STAMP).read_text())
    assert stamp["files"]["model.safetensors"] == cached["files"]["model.safetensors"] == \
        sha256_file(real_model_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tokenizer.decode(logits.argmax()).strip() == "Paris"
