"""merge-lora for DoRA and IA3 adapters (and QLoRA bases): the streaming merge against peft's own merge and
against the unmerged model's logits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from support.rows import alpaca_rows, write_jsonl
from gpupoor.cli import app
from support.merge import assert_merges_as_trained_only_into_the_dequantized_base
from support.merge_methods import runner

PROBE = torch.tensor([[1, 5, 9, 17, 33, 60, 2, 7, 11, 90], [3, 8, 13, 21, 34, 55, 89, 144, 233, 377]])


def merge(*args) -> object:
    return runner.invoke(app, ["merge-lora", *map(str, args)])


def logits(model, ids=PROBE) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def relative_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| over the root-mean-square of `theirs`, in float64."""
    ours, theirs = ours.double(), theirs.double()
    return float((ours - theirs).abs().max() / max(theirs.norm() / math.sqrt(theirs.numel()), 1e-30))


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, tokenizer) -> Path:
    """GPT-2 stores its projections as Conv1D, (in, out): peft's fan_in_fan_out. Its projections have biases."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "gpt2"
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # not zero, so that IA3's scaling of the output biases shows
                param.normal_(0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def peft_config(case: str):
    from peft import IA3Config, LoraConfig

    return {
        # init_lora_weights=False: B is random, not zero, so the adapter is no identity
        "dora": LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules="all-linear",
                           modules_to_save=["lm_head"]),
        "dora-rslora": LoraConfig(r=4, lora_alpha=16, use_dora=True, use_rslora=True, init_lora_weights=False,
                                  target_modules=["q_proj", "v_proj", "up_proj"], alpha_pattern={"v_proj": 4}),
        "ia3": IA3Config(init_ia3_weights=False, target_modules=["k_proj", "v_proj", "down_proj"],
                         feedforward_modules=["down_proj"]),
        "dora-gpt2": LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, fan_in_fan_out=True,
                                target_modules=["c_attn", "c_proj", "c_fc"]),
        "ia3-gpt2": IA3Config(init_ia3_weights=False, fan_in_fan_out=True, target_modules=["c_attn", "mlp.c_proj"],
                              feedforward_modules=["mlp.c_proj"]),
    }[case]


def build_adapter(base: Path, case: str, out: Path, seed: int = 0) -> Path:
    """A saved peft adapter that changes the model in every way its kind can: random B, magnitudes that are
    not the norms of W + s B A (so the DoRA rescaling matters), IA3 scalings around 1, a trained head."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft_config(case))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
            elif "ia3_l" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
            elif "modules_to_save" in name:
                param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(out)
    return out


# case -> (base fixture, how many base tensors the merge must change)
CASES = {"dora": ("tiny_model", 15), "dora-rslora": ("tiny_model", 6), "ia3": ("tiny_model", 6),
         "dora-gpt2": ("tiny_gpt2", 8), "ia3-gpt2": ("tiny_gpt2", 6)}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_merge_and_the_unmerged_logits(case, request, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fixture, changed_expected = CASES[case]
    base = request.getfixturevalue(fixture)
    adapter = build_adapter(base, case, tmp_path / "adapter")
    result = merge(adapter, "--output", tmp_path / "merged", "--verify")
    assert result.exit_code == 0, result.output
    assert float(result.output.split("as trained = ")[1].split()[0]) < 1e-4

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    original = AutoModelForCausalLM.from_pretrained(base)
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    with_adapter = logits(unmerged)
    reference = unmerged.merge_and_unload()
    ours, theirs, before = merged.state_dict(), reference.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    changed = 0
    for name in ours:
        assert relative_gap(ours[name], theirs[name]) < 1e-6, name
        changed += not torch.allclose(ours[name], before[name], atol=1e-4)
    assert changed == changed_expected  # every targeted weight (and bias, for IA3 on GPT-2) moved
    assert relative_gap(logits(merged), with_adapter) < 3e-5
    assert relative_gap(logits(merged), logits(original)) > 1e-2  # the adapter is no identity
    card = (tmp_path / "merged" / "README.md").read_text()
    assert f"# {'IA3' if case.startswith('ia3') else 'DoRA'} fine-tune" in card


def test_dora_magnitudes_are_what_the_merge_uses(tiny_model, tmp_path):
    """A DoRA adapter whose magnitudes are scaled by 2 merges into weights scaled by 2, row for row."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    adapter = build_adapter(tiny_model, "dora-rslora", tmp_path / "a")
    doubled = tmp_path / "b"
    shutil.copytree(adapter, doubled)
    tensors = load_file(adapter / "adapter_model.safetensors")
    magnitudes = [key for key in tensors if key.endswith(".lora_magnitude_vector")]
    assert len(magnitudes) == 6 and all(tensors[key].ndim == 1 for key in magnitudes)
    save_file({key: t * 2 if key in magnitudes else t for key, t in tensors.items()},
              doubled / "adapter_model.safetensors")
    for source, out in ((adapter, "ma"), (doubled, "mb")):
        assert merge(source, "--output", tmp_path / out).exit_code == 0
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "ma").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "mb").state_dict()
    for key in magnitudes:
        name = key.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")
        assert torch.allclose(b[name], 2 * a[name], rtol=1e-6, atol=0), name


@pytest.mark.parametrize("case", ["dora", "ia3"])
def test_adapter_of_another_model_is_refused(case, tiny_model, tokenizer, tmp_path):
    from gpupoor.model.tiny import build_tiny_llama

    adapter = build_adapter(tiny_model, case, tmp_path / "adapter")
    wider = build_tiny_llama(tmp_path / "wider", tokenizer, hidden=48, layers=2, heads=4, kv_heads=2)
    result = merge(adapter, "--output", tmp_path / "m", "--base", wider)
    assert result.exit_code == 2 and "trained on another model" in result.output and "--base" in result.output
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".tmp-*"))


def test_ia3_adapter_on_another_architecture_is_refused(tiny_model, tiny_gpt2, tmp_path):
    adapter = build_adapter(tiny_model, "ia3", tmp_path / "adapter")
    result = merge(adapter, "--output", tmp_path / "m", "--base", tiny_gpt2)
    assert result.exit_code == 2 and "another architecture" in result.output


def test_broken_or_unknown_adapters_are_refused(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    adapter = build_adapter(tiny_model, "dora-rslora", tmp_path / "dora")
    tensors = load_file(adapter / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())

    def variant(name: str, config_changes: dict, keep=lambda key: True) -> Path:
        path = tmp_path / name
        shutil.copytree(adapter, path)
        (path / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
        save_file({k: t for k, t in tensors.items() if keep(k)}, path / "adapter_model.safetensors")
        return path

    cases = [
        (variant("not-dora", {"use_dora": False}), "unsupported adapter tensor"),  # magnitudes in a LoRA
        (variant("no-magnitude", {}, lambda k: "q_proj.lora_magnitude_vector" not in k), "incomplete"),
        (variant("loha", {"peft_type": "LOHA"}), "only LoRA, DoRA and IA3 adapters can be merged"),
        (variant("as-ia3", {"peft_type": "IA3"}), "unsupported adapter tensor"),
    ]
    for path, message in cases:
        result = merge(path, "--output", tmp_path / f"out-{path.name}")
        assert result.exit_code == 2 and message in result.output, (path.name, result.output)


