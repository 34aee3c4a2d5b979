"""Masked attention with grouped key/value heads: repeated to every query head first (transformers' SDPA function
under a mask: repeat_kv) against shared inside SDPA (enable_gqa, gpupoor.model.packed_attention
.masked_shared_heads). Forward and backward of one layer's attention at the real model's heads (9 query, 3 key/value,
64 wide), best of `--repeats`, the two alternated; and the bytes autograd keeps for backward.

    python bench/gqa_attention.py [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (what, rows, query positions, key positions): GRPO's answers after their prompts' cache, a padded SFT batch
SHAPES = [("GRPO update: 16 answers x 16 tokens after 129 cached", 16, 16, 145),
          ("padded rows: 8 x 256", 8, 256, 256), ("GRPO prompts: 4 x 129", 4, 129, 129)]
HEADS, KV_HEADS, DIM = 9, 3, 64


def one(rows: int, queries: int, keys: int, shared: bool) -> tuple[float, int]:
    torch.manual_seed(0)
    q = torch.randn(rows, HEADS, queries, DIM, requires_grad=True)
    k = torch.randn(rows, KV_HEADS, keys, DIM, requires_grad=True)
    v = torch.randn(rows, KV_HEADS, keys, DIM, requires_grad=True)
    mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
    mask[1:, :, :, :5] = False  # left padding on all rows but the first
    kept = {}

    def keep(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if shared:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            from transformers.integrations.sdpa_attention import repeat_kv

            groups = HEADS // KV_HEADS
            out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)
    out.sum().backward()
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    return time.perf_counter() - start, sum(n for ptr, n in kept.items() if ptr not in inputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| shape | repeated: ms | shared: ms | repeated: kept KiB | shared: kept KiB |\n|---|---:|---:|---:|---:|")
    for what, rows, queries, keys in SHAPES:
        best = {True: (1e9, 0), False: (1e9, 0)}
        for _ in range(args.repeats):
            for shared in (False, True):
                seconds, kept = one(rows, queries, keys, shared)
                best[shared] = (min(best[shared][0], seconds), kept)
        print(f"| {what} | {best[False][0] * 1e3:.2f} | {best[True][0] * 1e3:.2f} | {best[False][1] // 1024:,} | "
              f"{best[True][1] // 1024:,} |")


if __name__ == "__main__":
    main()
