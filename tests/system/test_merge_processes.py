"""The system tier of test_merge.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from support.merge import lora_run, merge, workdir


def test_merged_directory_is_complete_and_standard(lora_run, tmp_path):
    assert merge(lora_run, "--output", tmp_path / "m", "--dtype", "bf16").exit_code == 0
    out = tmp_path / "m"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"} <= names
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    assert "rank 4" in card and "| loss |" in card and "library_name: transformers" in card
    assert "base_model:" not in card  # a local base is no hub id: the hub would refuse the card
    # plain transformers in a fresh interpreter, gpupoor not imported
    code = (f"from transformers import AutoModelForCausalLM, AutoTokenizer; m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
            f"t = AutoTokenizer.from_pretrained({str(out)!r}); print(m.dtype, 'gpupoor' in __import__('sys').modules)")
    out_text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out_text.split() == ["torch.bfloat16", "False"]


def test_streaming_merge_peak_memory_stays_near_one_shard(tmp_path, tokenizer):
    """A 64 MB model in 4 MB shards: merging must grow the process by a few shards, not by the model."""
    from gpupoor.model.tiny import build_tiny_llama

    base = build_tiny_llama(tmp_path / "big", tokenizer, hidden=256, layers=16, heads=4, kv_heads=4,
                            intermediate=1024)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    model.save_pretrained(tmp_path / "big-sharded", max_shard_size="4MB")
    tokenizer.save_pretrained(tmp_path / "big-sharded")
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    del model, peft_model
    # The first merge in a process also pays for lazy imports; the second shows what merging itself costs.
    # Peak RSS is reset through /proc/self/clear_refs, so it is the peak of this merge alone.
    code = f"""
import re, shutil
from pathlib import Path
from gpupoor.model.merge import merge_lora
from gpupoor.storage.run_weights import RunWeights
def kib(field): return int(re.search(field + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1))
for out in ('warmup', 'out'):
    open('/proc/self/clear_refs', 'w').write('5')
    before = kib('VmRSS')
    merge_lora(RunWeights(Path({str(tmp_path / 'adapter')!r}), None), Path({str(tmp_path)!r}) / out,
               base={str(tmp_path / 'big-sharded')!r}, max_shard_bytes=4 * 10**6, say=lambda *a: None)
print(before * 1024, kib('VmHWM') * 1024)
"""
    before, after = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert model_bytes > 60 * 2**20
    assert after - before < 0.35 * model_bytes, (after - before, model_bytes)
