"""`gpupoor export` of the real SmolLM2-135M-Instruct (width 576, no multiple of 256: its K-type files fall back
per tensor as llama.cpp's do): the files read back by transformers give the model's logits within each type's
bound, and its tokenizer gives the original ids on a multilingual sample. (The quality table is measured in the
unit and integration tiers and, on the real demo's run, in docs/export.md; here each load costs ~20 s.)"""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from gpupoor.cli import app

SAMPLE = ("Grüße aus Köln! 你好，世界。Привет, мир! こんにちは. Ελληνικά. The meeting moved to March 3rd, 2024 "
          "at 10:30; call +1-555-0100. <|im_start|>user\nhi<|im_end|>")
# Relative logit error (Frobenius norm) on SAMPLE, measured on this model: q4_k_m 0.103 (q8_0 0.021, q4_0 0.323).
# One type read back: each read costs ~35 s here (transformers parses the 49k-token vocabulary twice); q4_k_m
# covers the K types, llama.cpp's per-tensor rules and the fallbacks of a width (576) no multiple of 256.
BOUNDS = {"q4_k_m": 0.2}


def test_smollm2_exports_and_reads_back_within_each_types_bound(real_model_dir, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = CliRunner().invoke(app, ["export", str(real_model_dir), *sum((["-q", q] for q in BOUNDS), []),
                                      "--output", str(tmp_path / "smol-q4_k_m.gguf"), "--no-quality"])
    assert result.exit_code == 0, result.output
    original = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    ids = tokenizer(SAMPLE, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = original(ids).logits
    for quant, bound in BOUNDS.items():
        path = tmp_path / f"smol-{quant}.gguf"
        back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            error = float((back(ids).logits - reference).norm() / reference.norm())
        print(f"{quant}: relative logit error {error:.3g}")
        assert 0 < error < bound, f"{quant}: {error:.3g}"
        read = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        assert read(SAMPLE).input_ids == ids[0].tolist()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "smol-q4_k_m.gguf")).tensors}
    assert types["token_embd.weight"] == "Q8_0"  # the tied head: Q6_K wanted, 576 % 256 != 0
    assert types["blk.4.attn_q.weight"] == "Q5_0"  # Q4_K wanted, falls back
    assert types["blk.4.ffn_down.weight"] == "Q4_K"  # rows of 1536 = 6 x 256
    # 30 layers: use_more_bits picks 0-2 (first eighth), 26-29 (last), and 5, 8, ... 23 (every third from 3)
    assert [layer for layer in range(30) if types[f"blk.{layer}.ffn_down.weight"] == "Q6_K"] == \
        [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
