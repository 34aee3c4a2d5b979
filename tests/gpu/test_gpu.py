"""Paths that only a CUDA GPU exercises. Skipped without one; run on the device machine when lent."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl
from support.runs import assert_same_run, losses, read_metrics
from gpupoor.cli import app

pytestmark = pytest.mark.gpu


def test_auto_precision_and_device_on_gpu(make_recipe, tmp_path):
    import torch

    result = CliRunner().invoke(app, ["train", str(make_recipe(training={"device": "auto", "max_steps": 4})),
                                      "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    expected = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    assert "device cuda" in result.output and f"precision {expected}" in result.output
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[-1]["peak_mem_mb"] > 0


def test_qlora_on_gpu(make_recipe, tmp_path):
    result = CliRunner().invoke(app, ["train", str(make_recipe(quantization={"bits": 4}, training={"max_steps": 4})),
                                      "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps and steps[-1]["step"] == 4 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["peak_mem_mb"] > 0 and (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


def _one_batch(tmp_path) -> dict:
    """A data section of four rows: with micro-batches of four every step sees the same batch, so the loss falls."""
    return {"path": str(write_jsonl(tmp_path / "four.jsonl", alpaca_rows(4)))}


def _trains(result, run) -> list[float]:
    """The run's step losses, after checking it finished: every one finite."""
    assert result.exit_code == 0, result.output
    values = [loss for _, loss in losses(run)]
    assert values and all(math.isfinite(v) for v in values)
    return values


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_lora_learns_on_gpu(make_recipe, tmp_path, precision):
    """bf16 autocast, and fp16 with its GradScaler: the loss on a repeated batch falls."""
    recipe = make_recipe(precision=precision, data=_one_batch(tmp_path),
                         training={"device": "cuda", "max_steps": 12, "micro_batch_size": 4,
                                                   "learning_rate": 5e-2})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    values = _trains(result, tmp_path / "run")
    assert f"precision {precision}" in result.output
    assert sum(values[-3:]) < sum(values[:3]) - 0.1, values  # fp32: it falls by ~0.2; bf16 rounds ~0.02


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_bitsandbytes_optimizers_on_gpu(make_recipe, tmp_path, optimizer):
    recipe = make_recipe(precision="bf16", data=_one_batch(tmp_path),
                         training={"device": "cuda", "max_steps": 12, "optimizer": optimizer,
                                                   "learning_rate": 5e-2})
    values = _trains(invoke("train", recipe, "--output-dir", tmp_path / "run"), tmp_path / "run")
    assert sum(values[-3:]) < sum(values[:3]) - 0.1, values  # fp32: it falls by ~0.2; bf16 rounds ~0.02


def test_offloaded_checkpointing_on_gpu_matches_plain(make_recipe, tmp_path):
    """Activations kept in CPU memory between forward and backward give the same losses as keeping them."""
    runs = {}
    for name, setting in (("plain", False), ("offload", "offload")):
        recipe = make_recipe(f"{name}.yaml", precision="fp32", memory={"gradient_checkpointing": setting},
                             training={"device": "cuda", "max_steps": 4})
        runs[name] = _trains(invoke("train", recipe, "--output-dir", tmp_path / name), tmp_path / name)
    assert runs["offload"] == pytest.approx(runs["plain"], rel=1e-4)


def test_resume_on_gpu_is_bitwise(make_recipe, tmp_path, monkeypatch):
    """The promise the CPU tiers test, on CUDA kernels: stopped at step 3 and resumed, every loss and the final
    adapter equal the uninterrupted run's bitwise."""
    recipe = make_recipe(precision="bf16", training={"device": "cuda", "max_steps": 6},
                         checkpoint={"every_steps": 3})
    _trains(invoke("train", recipe, "--output-dir", tmp_path / "straight", monkeypatch=monkeypatch),
            tmp_path / "straight")
    stopped = invoke("train", recipe, "--output-dir", tmp_path / "stopped", monkeypatch=monkeypatch,
                     fault="sigterm@3")
    assert stopped.exit_code == 75, stopped.output
    resumed = invoke("resume", tmp_path / "stopped", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    assert_same_run(tmp_path / "straight", tmp_path / "stopped")


def test_plan_on_gpu_is_close_to_the_measured_peak(make_recipe, tmp_path):
    """`gpupoor plan` on CUDA against the tensors torch allocated (metrics' peak_mem_mb): the terms it adds up
    are the ones a GPU run holds, the cuBLAS workspaces included (half of this tiny run's measured peak)."""
    import json

    recipe = make_recipe(precision="bf16", data={"max_length": 512, "sampler": "packed"},
                         training={"device": "cuda", "max_steps": 3, "micro_batch_size": 8})
    _trains(invoke("train", recipe, "--output-dir", tmp_path / "run"), tmp_path / "run")
    measured = max(r["peak_mem_mb"] for r in read_metrics(tmp_path / "run") if "peak_mem_mb" in r)
    plan = json.loads(invoke("plan", recipe, "--json").output)
    predicted = (plan["peak_bytes"] - plan["terms"]["overhead"]["bytes"]) / 2**20
    assert plan["device"] == "cuda"
    assert predicted == pytest.approx(measured, rel=0.25), (predicted, measured, plan["terms"])


def test_flash_attention_packing_equals_one_by_one(tiny_model, tokenizer):
    """flash-attn 2 varlen kernels through restarted position_ids, bf16 on the GPU."""
    pytest.importorskip("flash_attn")
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from gpupoor.data.build import collate_packed
    from gpupoor.data.assembly import IGNORE_INDEX
    from support.packing import TEXTS, _dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="flash_attention_2",
                                                 dtype=torch.bfloat16).cuda()
    dataset = _dataset(tokenizer, TEXTS)
    packed = {k: v.cuda() for k, v in collate_packed(dataset, [0, 1, 2, 3]).items()}
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        total = F.cross_entropy(logits[0, :-1].float(), packed["labels"][0, 1:], ignore_index=IGNORE_INDEX,
                                reduction="sum")
        single = 0.0
        for index in range(4):
            one = {k: v.cuda() for k, v in collate_packed(dataset, [index]).items()}
            out = model(input_ids=one["input_ids"], use_cache=False).logits
            single += F.cross_entropy(out[0, :-1].float(), one["labels"][0, 1:], ignore_index=IGNORE_INDEX,
                                      reduction="sum")
    assert torch.allclose(total, single, rtol=2e-2)  # bf16 kernels: same numbers up to rounding


def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL takes one process per GPU)")


@pytest.mark.parametrize("settings", [["precision=bf16"], ["precision=fp16"],
                                      ["precision=bf16", "distributed.cpu_offload=true"]])
def test_fsdp_on_two_gpus_trains_like_one_and_resumes(make_recipe, tmp_path, settings):
    """nccl, FSDP2 in half precision (fp16: ShardedGradScaler), CPU offload; stopped on rank 1 and resumed."""
    _two_gpus()
    from support.distributed import exit_codes, losses, one_process, torchrun

    recipe = make_recipe(training={"device": "cuda", "max_steps": 4, "micro_batch_size": 2})
    sets = [arg for setting in settings for arg in ("--set", setting)]
    one = one_process("train", recipe, "--output-dir", tmp_path / "one", *sets,
                      "--set", "training.gradient_accumulation_steps=2")
    assert one.returncode == 0, one.stderr[-2000:]
    stopped = torchrun("train", recipe, "--output-dir", tmp_path / "fsdp", *sets, "--set",
                       "distributed.strategy=fsdp", fault="rank1/sigterm@2")
    assert exit_codes(stopped) == [75, 75], stopped.stderr[-3000:]
    assert "(FSDP, nccl" in stopped.stdout
    resumed = torchrun("resume", tmp_path / "fsdp")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    reference = [loss for _, loss, _ in losses(tmp_path / "one")]
    assert [loss for _, loss, _ in losses(tmp_path / "fsdp")] == pytest.approx(reference, rel=2e-2)


def test_profile_on_gpu_records_a_memory_snapshot(make_recipe, tmp_path):
    result = CliRunner().invoke(app, ["train", str(make_recipe(training={"device": "cuda", "max_steps": 6})),
                                      "--output-dir", str(tmp_path / "run"), "--profile", "2"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "profile" / "memory_snapshot-rank0.pickle").stat().st_size > 0


def test_fused_layers_in_bf16_on_gpu_match_the_plain_modules():
    """The fused LoRA linears and gated MLP run in bf16 on a GPU by default (issue #47: 16% faster, 36% less memory
    on an H100): their loss and adapter gradients against peft's modules on the same bf16 weights, to bf16's
    rounding (2^-8) scaled to each tensor's norm."""
    import copy

    import torch

    from gpupoor.model.fast_paths import apply_fast_paths
    from support.fused_layers import VOCAB, tiny_family, with_lora

    plain = with_lora(tiny_family("llama", dtype=torch.bfloat16)).cuda()
    for param in plain.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # adapters in fp32 over the bf16 base, as gpupoor trains
    fused = copy.deepcopy(plain)
    assert apply_fast_paths(fused, True, precision="bf16").value == "on"
    ids = torch.randint(0, VOCAB, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for model in (plain, fused):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (fused_loss, fused_grads) = results
    assert abs(fused_loss - loss) <= 2**-6 * abs(loss)
    assert grads.keys() == fused_grads.keys() and grads
    for name, grad in grads.items():
        assert (fused_grads[name] - grad).norm() <= 2**-5 * grad.norm() + 1e-6, name
