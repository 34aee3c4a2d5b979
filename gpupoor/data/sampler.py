"""Deterministic batch plans: the micro-batches of epoch e are a pure function of (seed, epoch).

A position in the data is therefore just (epoch, micro-batches consumed in that epoch): resuming slices the
plan in O(1) instead of replaying batches.
"""

from __future__ import annotations

import torch

# Length-grouped sampling sorts within windows of this many micro-batches: big enough to cut most padding,
# small enough that batch order stays random (the HF Trainer uses 50 as well).
MEGABATCH_FACTOR = 50


def _generator(seed: int, epoch: int) -> torch.Generator:
    # Mix seed and epoch so (seed, epoch) pairs never collide for realistic values.
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63 - 1))


class BatchPlan:
    """Splits example indices into micro-batches, anew for every epoch."""

    def __init__(self, lengths: list[int], micro_batch_size: int, seed: int, kind: str = "random"):
        if kind not in ("random", "length_grouped"):
            raise ValueError(f"unknown sampler {kind!r}")
        self.lengths = lengths
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.kind = kind

    def __len__(self) -> int:
        """Micro-batches per epoch (the last one may be smaller)."""
        return -(-len(self.lengths) // self.micro_batch_size)

    def epoch(self, epoch: int) -> list[list[int]]:
        generator = _generator(self.seed, epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size = self.micro_batch_size
        if self.kind == "random":
            return [order[i:i + size] for i in range(0, len(order), size)]
        window = size * MEGABATCH_FACTOR
        batches = []
        for start in range(0, len(order), window):
            group = sorted(order[start:start + window], key=lambda i: -self.lengths[i])
            batches += [group[i:i + size] for i in range(0, len(group), size)]
        # Shuffle the batch order so long batches do not all come first.
        shuffled = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in shuffled]
