"""Every verb that loads a run's base checks it against the manifest (issue #41): a base replaced at the recorded
path is refused by export, merge-lora, generate and chat (exit 2, naming the file), accepted with --force and a
warning, and shown by status."""

from __future__ import annotations

import shutil

import pytest

from support.cli import invoke
from support.recipes import write_recipe
from support.rows import alpaca_rows, write_jsonl

STEPS = {"training": {"max_steps": 2}}


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, tokenizer):
    """Another tiny Llama of the same shape (other weights): what a swapped base looks like."""
    from gpupoor.model.tiny import build_tiny_llama, write_tiny_gguf

    root = tmp_path_factory.mktemp("other")
    directory = build_tiny_llama(root / "other", tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, seed=7)
    return directory, write_tiny_gguf(directory, root / "other.gguf")


def _train_on(base, root):
    data = write_jsonl(root / "train.jsonl", alpaca_rows(24))
    run = root / "run"
    result = invoke("train", write_recipe(root / "r.yaml", base, data, **STEPS), "--output-dir", run)
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory, tiny_gguf):
    root = tmp_path_factory.mktemp("swap-gguf")
    base = root / "swap.gguf"
    shutil.copy(tiny_gguf, base)
    return _train_on(base, root), base


@pytest.fixture(scope="module")
def directory_run(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("swap-dir")
    base = root / "base"
    shutil.copytree(tiny_model, base)
    return _train_on(base, root), base / "model.safetensors"


@pytest.fixture()
def swapped(request, other_model):
    """(run, the base file) with another model's file copied over the base; the original put back after."""
    run, base = request.getfixturevalue(request.param)
    original = base.read_bytes()
    shutil.copy(other_model[1] if base.suffix == ".gguf" else other_model[0] / base.name, base)
    yield run, base
    base.write_bytes(original)


@pytest.mark.parametrize("swapped", ["gguf_run", "directory_run"], indirect=True)
def test_a_swapped_base_is_refused_by_every_verb_that_loads_it(swapped, tmp_path):
    run, base = swapped
    changed = f"{base.name} changed"
    exported = invoke("export", run, "-q", "f32", "--no-quality")
    assert exported.exit_code == 2 and changed in exported.output, exported.output
    assert "--force" in exported.output and not (run / "gguf").exists()
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged")
    assert merged.exit_code == 2 and changed in merged.output, merged.output
    assert not (tmp_path / "merged").exists()
    generated = invoke("generate", run, "--prompt", "hello", "--max-new-tokens", "2")
    assert generated.exit_code == 2 and changed in generated.output, generated.output
    chatted = invoke("chat", run, "--max-new-tokens", "2")
    assert chatted.exit_code == 2 and changed in chatted.output, chatted.output
    status = invoke("status", run)
    assert "the base model changed since the run trained on it" in status.output and changed in status.output


@pytest.mark.parametrize("swapped", ["gguf_run"], indirect=True)
def test_force_goes_on_with_the_changed_base_and_says_so(swapped, tmp_path):
    run, base = swapped
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged", "--force")
    assert merged.exit_code == 0, merged.output
    assert "warning: --force: the base model changed" in merged.output and f"{base.name} changed" in merged.output
    generated = invoke("generate", run, "--prompt", "hello", "--max-new-tokens", "2", "--force")
    assert generated.exit_code == 0 and "--force: the base model changed" in generated.output, generated.output
    chatted = invoke("chat", run, "--max-new-tokens", "2", "--force")
    assert chatted.exit_code == 0 and "--force: the base model changed" in chatted.output, chatted.output
    exported = invoke("export", run, "-q", "f32", "--no-quality", "--output", tmp_path / "x.gguf", "--force")
    assert exported.exit_code == 0 and "--force: the base model changed" in exported.output, exported.output
    assert (tmp_path / "x.gguf").is_file()


def test_a_base_gone_from_its_path_is_said_as_gone(gguf_run, tmp_path):
    """Not "changed" with a --force that could not load it: the base is not there; --base names where it is now."""
    run, base = gguf_run
    moved = tmp_path / "moved.gguf"
    base.rename(moved)
    try:
        merged = invoke("merge-lora", run, "--output", tmp_path / "merged")
        assert merged.exit_code == 2 and f"no longer at {base}" in merged.output, merged.output
        assert "--base" in merged.output
        elsewhere = invoke("merge-lora", run, "--output", tmp_path / "merged", "--base", moved)
        assert elsewhere.exit_code == 0, elsewhere.output
    finally:
        moved.rename(base)


def test_the_same_bytes_put_back_are_the_same_base(gguf_run, tmp_path):
    """Rewriting the file changes its stat, not its content: it is hashed again and accepted, silently."""
    run, base = gguf_run
    base.write_bytes(base.read_bytes())
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged")
    assert merged.exit_code == 0 and "changed" not in merged.output, merged.output
    status = invoke("status", run)
    assert "changed since the run trained" not in status.output, status.output


def test_another_base_named_with_base_is_a_choice_not_a_swap(gguf_run, other_model, tmp_path):
    """--base naming another file of the same shape: the user chose it (merge checks it fits); no refusal."""
    run, _ = gguf_run
    merged = invoke("merge-lora", run, "--output", tmp_path / "merged", "--base", other_model[1])
    assert merged.exit_code == 0 and "changed" not in merged.output, merged.output
