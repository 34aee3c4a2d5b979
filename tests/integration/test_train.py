"""End-to-end training on tiny models: the CLI, the loop's numerics, outputs that peft loads."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from support.runs import read_metrics
from gpupoor.cli import app

runner = CliRunner()


def train(*args: str):
    return runner.invoke(app, ["train", *map(str, args)])


def test_train_loss_falls_and_writes_a_complete_run_dir(make_recipe, tmp_path):
    recipe = make_recipe(training={"max_steps": 12, "learning_rate": 2e-2}, data={"eval_rows": 8},
                         checkpoint={"every_steps": 5, "keep_last": 3})
    result = train(recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    records = read_metrics(run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_mb", "elapsed_s"):
        assert all(key in r for r in steps), key
    assert sum(r["loss"] for r in steps[-3:]) < sum(r["loss"] for r in steps[:3])  # it learns
    evals = [r for r in records if "eval_loss" in r]
    assert evals and evals[-1]["step"] == 12 and math.isfinite(evals[-1]["eval_loss"])
    # Where the start-up went, part by part, in the session's start record and the summary's "ready in" line.
    startup = next(r for r in records if r.get("event") == "start")["startup_s"]
    assert list(startup)[-4:] == ["accelerator and tokenizer", "data", "model", "optimizer"]
    assert all(seconds >= 0 for seconds in startup.values()) and "ready in " in result.output
    saved = yaml_load(run / "recipe.yaml")
    assert saved["training"]["max_steps"] == 12 and "# torch " in (run / "recipe.yaml").read_text()
    # Every 5 steps plus one at the end (so the run can be extended), the 3 newest kept.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000005", "step-000010", "step-000012"]
    manifest = json.loads((run / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["step"] == 10 and "adapter_model.safetensors" in manifest["files"]
    assert (run / "final" / "adapter_model.safetensors").is_file()
    assert not list(run.glob(".tmp-*")) and not list((run / "checkpoints").glob(".tmp-*"))


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_final_adapter_loads_with_plain_peft_and_changes_the_output(make_recipe, tmp_path, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert train(make_recipe(), "--output-dir", tmp_path / "run").exit_code == 0
    final = tmp_path / "run" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model) and config["r"] == 4
    tokenizer = AutoTokenizer.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = tokenizer("sort the lists", return_tensors="pt").input_ids
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), final)
        after = tuned(ids).logits
    assert not torch.allclose(before, after, atol=1e-4)


def run_steps(make_recipe, tmp_path, name, **sections):
    recipe = make_recipe(f"{name}.yaml", **sections)
    result = train(recipe, "--output-dir", tmp_path / name)
    assert result.exit_code == 0, result.output
    return [r for r in read_metrics(tmp_path / name) if "loss" in r]


def test_accumulation_normalizes_by_target_tokens(make_recipe, tmp_path):
    """Micro batch 4 x accum 1 and micro batch 1 x accum 4 see the same examples per step (the plan is a
    function of the seed): with per-token normalization their loss and gradient norm agree."""
    common = {"max_steps": 3, "max_grad_norm": None}
    big = run_steps(make_recipe, tmp_path, "big", training={**common, "micro_batch_size": 4})
    small = run_steps(make_recipe, tmp_path, "small", training={**common, "micro_batch_size": 1,
                                                                  "gradient_accumulation_steps": 4})
    assert [r["target_tokens"] for r in big] == [r["target_tokens"] for r in small]
    # The first step starts from the same weights: loss and gradient norm must match closely.
    assert big[0]["loss"] == pytest.approx(small[0]["loss"], rel=1e-5)
    assert big[0]["grad_norm"] == pytest.approx(small[0]["grad_norm"], rel=1e-4)
    for b, s in zip(big, small):
        assert b["loss"] == pytest.approx(s["loss"], rel=1e-3)


def test_gradient_checkpointing_gives_the_same_losses(make_recipe, tmp_path):
    plain = run_steps(make_recipe, tmp_path, "plain", training={"max_steps": 3})
    ckpt = run_steps(make_recipe, tmp_path, "ckpt", training={"max_steps": 3}, memory={"gradient_checkpointing": True})
    assert [r["loss"] for r in plain] == pytest.approx([r["loss"] for r in ckpt], rel=1e-6)
    assert [r["grad_norm"] for r in plain] == pytest.approx([r["grad_norm"] for r in ckpt], rel=1e-5)


def test_same_seed_same_run_different_seed_different_run(make_recipe, tmp_path):
    first = run_steps(make_recipe, tmp_path, "a", training={"max_steps": 3})
    again = run_steps(make_recipe, tmp_path, "b", training={"max_steps": 3})
    other = run_steps(make_recipe, tmp_path, "c", training={"max_steps": 3}, seed=1)
    assert [r["loss"] for r in first] == [r["loss"] for r in again]
    assert [r["loss"] for r in first] != [r["loss"] for r in other]


def test_epochs_set_the_number_of_steps(make_recipe, tmp_path):
    # 48 rows, micro batch 4 -> 12 micro-batches per epoch; accumulation 2 -> 6 steps per epoch.
    steps = run_steps(make_recipe, tmp_path, "e", training={"max_steps": None, "epochs": 1.5,
                                                              "gradient_accumulation_steps": 2})
    assert len(steps) == 9 and steps[-1]["epoch"] == pytest.approx(1.5)


def test_lora_targets_dropout_and_modules_to_save(make_recipe, tmp_path):
    assert train(make_recipe(peft={"target_modules": ["q_proj", "v_proj"], "dropout": 0.1,
                                   "modules_to_save": ["lm_head"]}),
                 "--output-dir", tmp_path / "run").exit_code == 0
    config = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["modules_to_save"] == ["lm_head"]


def test_unknown_target_module_is_a_clear_error(make_recipe, tmp_path):
    result = train(make_recipe(peft={"target_modules": ["qkv_projection"]}), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and "peft.target_modules" in result.output
    assert not (tmp_path / "run").exists()


def test_frozen_base_weights_never_change(make_recipe, tmp_path, tiny_model):
    from safetensors.torch import load_file

    import gpupoor.train.loop as loop
    from gpupoor.recipe.loading import load_recipe
    from gpupoor.run.orchestrate import train_from_recipe

    # Train in-process and compare every base weight of the trained model with the saved checkpoint.
    captured = {}
    original = loop.train

    def capture(model, *args, **kwargs):
        reason = original(model, *args, **kwargs)
        captured.update({n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad})
        return reason

    loop.train = capture  # train_from_recipe imports loop.train at call time
    try:
        train_from_recipe(load_recipe(make_recipe(training={"max_steps": 3})), str(tmp_path / "run"), say=lambda *_: None)
    finally:
        loop.train = original
    base = load_file(tiny_model / "model.safetensors")
    assert len(captured) == len(base)
    for name, tensor in captured.items():
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(tensor, base[key]), name


def test_refuses_a_non_empty_run_dir(make_recipe, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("precious")
    result = train(make_recipe(), "--output-dir", run)
    assert result.exit_code == 2 and "is not empty" in result.output and "--output-dir" in result.output
    assert (run / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("holds, advice", [
    ({"recipe.yaml": "x"}, "to continue it: gpupoor resume {run}; or pass --output-dir NEW_DIR"),
    ({"recipe.yaml": "x", "final/adapter_config.json": "{}"}, "it is a finished run (final/ is there): pass "
     "--output-dir NEW_DIR (or set output_dir) for a new run; to train it further: gpupoor resume {run} --set "
     "training.max_steps=N"),
    ({"notes.txt": "x"}, "pass --output-dir NEW_DIR (or set output_dir) for a new run, or delete the old files")])
def test_a_taken_run_dir_says_what_to_do_with_it(tmp_path, holds, advice):
    """An unfinished run is to be resumed; a finished one has nothing to resume: a new directory is the way."""
    from gpupoor.errors import UserError
    from gpupoor.storage.rundir import check_run_dir

    run = tmp_path / "run"
    for name, text in holds.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    with pytest.raises(UserError) as info:
        check_run_dir(run)
    assert advice.format(run=run) in info.value.hint


def test_smoke_runs_the_recipe_on_a_shrunken_model_and_leaves_nothing(make_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = train(make_recipe(training={"max_steps": 500, "micro_batch_size": 8}), "--smoke")
    assert result.exit_code == 0, result.output
    assert "shrunken random-weight copy" in result.output and "done: 3 steps" in result.output
    assert not (tmp_path / "runs").exists()


def test_smoke_runs_in_the_recipes_own_precision(make_recipe, tmp_path, monkeypatch):
    """A bf16 recipe smokes in bf16 (on a CPU whose bf16 units are pinned), an fp32 one in fp32; an fp16 recipe,
    which the CPU cannot train, says so and smokes in what auto chooses there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUPOOR_CPU_BF16", "AMX bf16:7.5")
    for requested, computed in (("bf16", "bf16"), ("fp32", "fp32"), ("fp16", "bf16")):
        result = train(make_recipe(f"{requested}.yaml", precision=requested), "--smoke")
        assert result.exit_code == 0, result.output
        assert f"precision {computed} (" in result.output, result.output
        assert ("the recipe's precision fp16 trains on a CUDA GPU only" in result.output) == (requested == "fp16")


def test_chat_and_text_formats_train(make_recipe, tmp_path):
    from support.rows import write_jsonl

    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "sort lists"}, {"role": "assistant", "content": "done quickly"}]}] * 8)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "the model learns to stop"}] * 8)
    for name, path, fmt in (("chat", chat, "chat"), ("text", text, "text")):
        template = {"chat_template": "chatml"} if fmt == "chat" else {}
        result = train(make_recipe(f"{name}.yaml", data={"path": str(path), "format": fmt, **template}),
                       "--output-dir", tmp_path / name)
        assert result.exit_code == 0, result.output
        steps = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        # each format's rows became targets the loss trained on: finite, and falling on 8 repeated rows
        assert steps and all(math.isfinite(r["loss"]) for r in steps), name
        assert steps[-1]["loss"] < steps[0]["loss"], (name, [r["loss"] for r in steps])


def test_bf16_autocast_on_cpu_trains(make_recipe, tmp_path):
    steps = run_steps(make_recipe, tmp_path, "bf16", precision="bf16", training={"max_steps": 2})
    assert all(math.isfinite(r["loss"]) for r in steps)


def test_fp16_on_cpu_is_refused(make_recipe, tmp_path):
    result = train(make_recipe(precision="fp16"), "--output-dir", tmp_path / "run")
    assert result.exit_code == 2 and "fp16" in result.output and "CUDA" in result.output


def test_qlora_4bit_trains_on_cpu(make_recipe, tmp_path):
    pytest.importorskip("bitsandbytes")
    steps = run_steps(make_recipe, tmp_path, "q4", quantization={"bits": 4}, training={"max_steps": 6})
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_time_limit_stops_with_a_checkpoint_and_exit_75(make_recipe, tmp_path):
    # What the run records, not how fast this machine is: how many steps fit in the limit is not asserted; that
    # the run stopped for the limit, with its last step checkpointed, is. (A limit that fits no step at all is
    # exit 2: tests/test_resume.py.)
    run = tmp_path / "run"
    # 15 s: start-up, a save's reserve and at least one step fit on a slow, busy machine (if none fitted, the
    # run would be exit 2, tested in test_resume.py).
    result = train(make_recipe(training={"max_steps": 100000}, checkpoint={"time_limit": "15s"}),
                   "--output-dir", run)
    assert result.exit_code == 75, result.output
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and 1 <= last < 100000
    assert (f"time limit 15s nearly reached: stopped after step {last} with checkpoint "
            f"checkpoints/step-{last:06d}") in result.output
    assert f"continue with: gpupoor resume {run}" in result.output
    checkpoints = list((run / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == [f"step-{last:06d}"]
    assert json.loads((checkpoints[0] / "manifest.json").read_text())["step"] == last
    assert not (run / "final").exists()  # stopped early: no final adapter
