"""The causal-LM loss as a sum over target tokens; the caller divides by the token count of the whole
accumulation window, so every target token weighs the same however the batch was split."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpupoor.data.formats import IGNORE_INDEX


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    # Position t predicts token t+1. Compute in fp32: a bf16 log-softmax over a large vocab loses precision.
    shifted = logits[:, :-1, :].float()
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
