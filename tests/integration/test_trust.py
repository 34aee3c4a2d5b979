"""Nothing read back is trusted unverified; resume keeps its promises in the cases users hit (issue #12)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.cli import invoke
from support.runs import read_metrics, reference_runs
from gpupoor.train.optim import lr_factor
from support.trust import full_disk_on


def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def adapter(run: Path) -> dict[str, torch.Tensor]:
    # Copies: the loaded tensors may map the file, which the tests then change.
    return {k: v.clone() for k, v in load_file(run / "final" / "adapter_model.safetensors").items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_model):
    return reference_runs(tmp_path_factory, tiny_model)


@pytest.fixture()
def finished_run(references, tmp_path):
    """A finished run of the test recipe: a copy of the one the module trained (a test may change its copy)."""
    run = tmp_path / "run"
    shutil.copytree(references(), run)
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
    assert third.exit_code == 0, third.output
    assert "tokenized cache hit" in third.output and "invalid" not in third.output
    assert not [p for p in entry.parent.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------------------------
# Resume semantics


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


# ---------------------------------------------------------------------------------------------------------------
# Signals and time limits end in exit 75 (requeue) or 2 (bad input), never a bare 143 or an endless requeue


def test_a_bad_time_limit_names_the_option(make_recipe):
    result = invoke("train", make_recipe(), "--time-limit", "5 parsecs")
    assert result.exit_code == 2 and "--time-limit '5 parsecs': not a positive duration" in result.output
    assert "--set" not in result.output


# ---------------------------------------------------------------------------------------------------------------
# Run directories that cannot be used are said to be so, before anything loads


def test_an_output_dir_that_is_a_file(make_recipe, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    result = invoke("train", make_recipe(), "--output-dir", target)
    assert result.exit_code == 2 and f"run directory {target} is a file" in result.output
    assert "not empty" not in result.output


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_output_dir_that_cannot_be_created(make_recipe, tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "plain").write_text("x")
        target = tmp_path / "plain" / "run"
    else:  # no process may create directories in /proc, root included
        target = Path("/proc") / "gpupoor-test" / "run"
    result = invoke("train", make_recipe(), "--output-dir", target)
    assert result.exit_code == 2, result.output
    assert f"cannot create the run directory {target}" in result.output and "Traceback" not in result.output
    assert not target.exists()


def test_a_full_disk_at_start_names_the_file_and_exits_1(make_recipe, tmp_path, monkeypatch):
    run = tmp_path / "run"
    full_disk_on(monkeypatch, f".{'recipe.yaml'}.")  # the first file a new run commits
    result = invoke("train", make_recipe(), "--output-dir", run)
    assert result.exit_code == 1, result.output
    assert f"error: {run / 'recipe.yaml'}: No space left on device (errno ENOSPC)" in result.output
    assert f"hint: free space on that file system (df -h {run})" in result.output and "Traceback" not in result.output
    assert [p.name for p in run.iterdir()] == [".lock"]  # nothing half-written
    monkeypatch.undo()  # space freed: the same command now works
    result = invoke("train", make_recipe(), "--output-dir", run)
    assert result.exit_code == 0, result.output


def test_a_full_disk_when_the_run_directory_is_probed_is_exit_1(make_recipe, tmp_path, monkeypatch):
    import errno
    import tempfile

    run = tmp_path / "new" / "run"

    def temporary_file(dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dir))

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    result = invoke("train", make_recipe(), "--output-dir", run)
    assert result.exit_code == 1, result.output  # the environment's failure, not bad input
    assert f"error: {run}: No space left on device (errno ENOSPC)" in result.output
    assert "cannot create the run directory" not in result.output and not (tmp_path / "new").exists()


def test_a_run_that_fails_while_loading_leaves_no_directory_behind(make_recipe, tiny_model, tmp_path):
    broken = tmp_path / "config-only"  # passes validate (it has a config), fails when the tokenizer loads
    broken.mkdir()
    shutil.copy(tiny_model / "config.json", broken / "config.json")
    target = tmp_path / "new" / "deeper" / "run"
    result = invoke("train", make_recipe(model={"name_or_path": str(broken)}), "--output-dir", target)
    assert result.exit_code == 2 and "cannot load a tokenizer" in result.output, result.output
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("flag", [[], ["--resume-if-present"]])
def test_a_start_that_ended_before_storing_its_recipe_leaves_a_fresh_start(make_recipe, tmp_path, flag):
    """Killed while the model loaded, or on a full disk: the run dir holds only the lock (its owner is gone) and
    maybe an unfinished recipe write. No run is there, so the same command starts it (a requeued job goes on)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("")
    (run / ".recipe.yaml.k2j4x9.tmp").write_text("model: {name_or_pa")
    result = invoke("train", make_recipe(), "--output-dir", run, *flag)
    assert result.exit_code == 0, result.output
    assert "not empty" not in result.output
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]
    assert (run / "final" / "adapter_model.safetensors").is_file()


def test_a_start_still_loading_in_the_run_dir_is_not_trained_over(make_recipe, tmp_path):
    from gpupoor.storage.rundir import RunLock

    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run).acquire()  # held, like a process that is still loading its model there
    try:
        for flag in ([], ["--resume-if-present"]):
            result = invoke("train", make_recipe(), "--output-dir", run, *flag)
            assert result.exit_code == 2, result.output
            assert f"another gpupoor process is starting a run in {run}" in result.output
    finally:
        lock.release()
    assert [p.name for p in run.iterdir()] == [".lock"]


def test_final_and_checkpoint_files_get_the_modes_open_gives(finished_run, tmp_path):
    probe = tmp_path / "probe"
    probe.write_text("x")
    expected = probe.stat().st_mode & 0o777
    written = [p for p in (finished_run / "final").iterdir()] + \
              [p for c in (finished_run / "checkpoints").iterdir() for p in c.iterdir()]
    assert any(p.name == "adapter_model.safetensors" for p in written)
    assert {p.name: p.stat().st_mode & 0o777 for p in written} == {p.name: expected for p in written}


# ---------------------------------------------------------------------------------------------------------------
# generate and merge-lora: bounded, and a wrong base is named


def test_generate_caps_new_tokens_at_the_models_context(finished_run):
    result = invoke("generate", finished_run, "--prompt", "sort lists", "--max-new-tokens", "1000000000")
    assert result.exit_code == 0, result.output
    assert "--max-new-tokens 1000000000 capped at" in result.output and "context is 1024 tokens" in result.output


def test_generate_with_a_base_of_another_architecture(finished_run, tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4)).save_pretrained(gpt2)
    result = invoke("generate", finished_run, "--prompt", "hi", "--base", gpt2)
    assert result.exit_code == 2 and "does not fit the base" in result.output and "--base" in result.output


def _tiny_qwen2(path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("command", ["generate", "merge-lora"])
@pytest.mark.parametrize("base, said", [
    ("deeper", "(2 decoder layers; the base has 4: layers 2-3 would run without it)"),
    ("shallower", "(it has weights for decoder layer 1; the base has 1 decoder layer)"),
    ("qwen2", "it was trained on another architecture (llama; the base is qwen2)"),
])
def test_a_base_of_another_shape_is_refused_before_loading(finished_run, tokenizer, tmp_path, command, base, said):
    # generate --base with a base of another depth or family applied part of the adapter silently (issue #25):
    # the adapter's layers and the run's recorded base are checked against the base's config.json first.
    from gpupoor.model.tiny import build_tiny_llama

    layers = {"deeper": 4, "shallower": 1}
    other = _tiny_qwen2(tmp_path / base, tokenizer) if base == "qwen2" else \
        build_tiny_llama(tmp_path / base, tokenizer, hidden=32, layers=layers[base], heads=4, kv_heads=2)
    extra = ["--output", tmp_path / "m"] if command == "merge-lora" else ["--prompt", "hi"]
    result = invoke(command, finished_run, *extra, "--base", other)
    assert result.exit_code == 2, result.output
    assert f"does not fit the base {other}: " in result.output and said in result.output, result.output
    assert "--base with the model the run trained on" in result.output
    assert not (tmp_path / "m").exists()
    # A run written before the record (no "models" in final/'s manifest): the base it names is read instead.
    if base == "qwen2":
        manifest = json.loads((finished_run / "final" / "manifest.json").read_text())
        del manifest["models"]
        (finished_run / "final" / "manifest.json").write_text(json.dumps(manifest))
        result = invoke(command, finished_run, *extra, "--base", other)
        assert result.exit_code == 2 and said in result.output, result.output


@pytest.mark.parametrize("command", ["merge-lora", "generate"])
def test_a_base_directory_without_config(finished_run, tmp_path, command):
    (tmp_path / "empty").mkdir()
    extra = ["--output", tmp_path / "m"] if command == "merge-lora" else ["--prompt", "hi"]
    result = invoke(command, finished_run, *extra, "--base", tmp_path / "empty")
    assert result.exit_code == 2 and "has no config.json" in result.output, result.output


# ---------------------------------------------------------------------------------------------------------------
# peft names that match nothing are errors, not silently ignored


@pytest.mark.parametrize("peft", [{"target_modules": ["q_proj", "qkv_projection"]},
                                  {"modules_to_save": ["lm_heads"]}])
def test_peft_names_that_match_no_module_fail_validate_and_train(make_recipe, tmp_path, peft):
    key = next(iter(peft))
    recipe = make_recipe(peft=peft)
    validated = invoke("validate", recipe)
    assert validated.exit_code == 2 and f"peft.{key}" in validated.output and "match no module" in validated.output
    trained = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert trained.exit_code == 2 and "match no module" in trained.output
    assert not (tmp_path / "run").exists()


def test_a_dotted_name_is_checked_against_the_built_model(make_recipe, tmp_path):
    recipe = make_recipe(peft={"modules_to_save": ["layers.9.mlp"]})  # the model has 2 layers
    assert invoke("validate", recipe).exit_code == 0  # the config alone cannot tell
    trained = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert trained.exit_code == 2 and "peft.modules_to_save: 'layers.9.mlp' match no module" in trained.output
    assert "post_attention_layernorm" in trained.output  # the hint lists the names it has


# ---------------------------------------------------------------------------------------------------------------
# Launching: the README's accelerate form never silently trains on one process


def test_the_startup_summary_says_how_many_processes_train(finished_run, make_recipe, tmp_path):
    result = invoke("train", make_recipe(), "--output-dir", tmp_path / "again")
    assert result.exit_code == 0, result.output
    assert "processes: 1 (no data parallelism)" in result.output


# ---------------------------------------------------------------------------------------------------------------
# A shipped recipe works as shipped


ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_recipe_validates_and_trains_on_a_fresh_clone(tmp_path):
    from gpupoor.storage.files import default_cache_dir

    built = default_cache_dir() / "models" / "demo-v1"  # the test's own empty cache: a fresh machine
    assert not built.exists()
    validated = invoke("validate", ROOT / "recipes" / "demo.yaml")
    assert validated.exit_code == 0, validated.output
    assert (built / "manifest.json").is_file() and (built / "config.json").is_file()
    smoke = invoke("train", ROOT / "recipes" / "demo.yaml", "--smoke")
    assert smoke.exit_code == 0 and "smoke test passed" in smoke.output


def test_a_damaged_builtin_model_is_built_again(tmp_path):
    from safetensors.torch import load_file as load

    from gpupoor.model.builtin import _VERIFIED, builtin_model

    first = builtin_model("demo")
    reference = {k: v.clone() for k, v in load(first / "model.safetensors").items()}
    flip_byte(first / "model.safetensors", 0.9)
    _VERIFIED.clear()  # as a new process would: the damage is found when the model is next verified
    again = builtin_model("demo")  # verified against its manifest, found damaged, built again from the seed
    rebuilt = load(again / "model.safetensors")
    assert again == first and all(torch.equal(rebuilt[k], reference[k]) for k in reference)
    with pytest.raises(Exception, match="no built-in model gpupoor:nope"):
        builtin_model("nope")


# ---------------------------------------------------------------------------------------------------------------
# Evaluation across a stop and an extension (two processes with fewer eval batches than processes:
# tests/system/test_distributed.py, test_a_stop_on_one_process_stops_all_at_one_step_and_resumes_bitwise)


def test_extending_a_finished_run_keeps_its_final_eval(make_recipe, tmp_path):
    recipe = make_recipe(training={"max_steps": 3}, data={"eval_rows": 8})
    run = tmp_path / "run"
    assert invoke("train", recipe, "--output-dir", run).exit_code == 0
    result = invoke("resume", run, "--set", "training.max_steps=5")
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run) if "eval_loss" in r] == [3, 5]


def test_an_old_checkpoint_that_cannot_be_removed_is_a_warning_not_a_failed_save(make_recipe, tmp_path, monkeypatch):
    # Rotation runs after the new checkpoint has landed: a failure there costs disk space, not work, so it must
    # not stop the run as a failed save would (exit 1, "could not write ...").
    import gpupoor.storage.checkpoint

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "checkpoints/step-000001")

    monkeypatch.setattr(gpupoor.storage.checkpoint, "rotate", refuse)
    run = tmp_path / "run"
    result = invoke("train", make_recipe(checkpoint={"every_steps": 1, "keep_last": 1}), "--output-dir", run,
                    monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert "warning: could not remove an old checkpoint" in result.output
    assert (run / "final" / "manifest.json").is_file() and (run / "checkpoints" / "step-000004").is_dir()
