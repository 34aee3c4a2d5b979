"""Shared by the packing tests (moved from unit/data/test_packing.py, whose tests still use them)."""

from __future__ import annotations

import torch

from gpupoor.data.dataset import TokenizedDataset, TokenStats


def _dataset(tokenizer, texts):
    pieces = []
    for text in texts:
        ids = torch.tensor([tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids
                           + [tokenizer.eos_token_id], dtype=torch.int32)
        target = torch.ones(len(ids), dtype=torch.uint8)
        target[:3] = 0  # a short prompt
        pieces.append((ids, target))
    offsets = torch.tensor([0] + [len(ids) for ids, _ in pieces]).cumsum(0)
    return TokenizedDataset(torch.cat([ids for ids, _ in pieces]), torch.cat([t for _, t in pieces]), offsets,
                            TokenStats())


TEXTS = ["the model learns to stop", "sort lists", "every token counts toward the loss when the answer is done",
         "resume data memory speed"]
