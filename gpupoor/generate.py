"""Greedy generation from a trained model in the prompt format it was trained on."""

from __future__ import annotations

import torch


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 32, batch_size: int = 32) -> list[str]:
    """Greedy completions (deterministic) of each prompt, decoded without special tokens."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only models continue from the last position
    model.eval()
    outputs = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True)
            batch = {k: v.to(model.device) for k, v in batch.items()}
            generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            new_tokens = generated[:, batch["input_ids"].shape[1]:]
            outputs += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return [text.strip() for text in outputs]
