"""Batches for loss tests."""

from __future__ import annotations



def masked_batch(tokenizer) -> dict:
    """A padded batch with a prompt, padding and a hole among the targets: what a loss must skip."""
    import torch

    from gpupoor.data.assembly import IGNORE_INDEX

    ids = torch.randint(5, len(tokenizer), (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # a prompt
    labels[mask == 0] = IGNORE_INDEX
    labels[2, 6] = IGNORE_INDEX  # a hole in the middle
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
