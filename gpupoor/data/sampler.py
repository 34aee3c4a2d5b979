"""Deterministic batch plans: the micro-batches of epoch e are a pure function of (seed, epoch).

A position in the data is therefore just (epoch, micro-batches consumed in that epoch): resuming slices the
plan in O(1) instead of replaying batches.
"""

from __future__ import annotations

import torch

# Length-grouped sampling sorts within windows of this many micro-batches: big enough to cut most padding,
# small enough that batch order stays random (the HF Trainer uses 50 as well).
MEGABATCH_FACTOR = 50
# Packing bins the examples of windows of this many shuffled examples: first-fit-decreasing fills bins
# nearly full once a window holds a few hundred examples, and the window keeps the order random.
PACK_WINDOW = 1000


def _generator(seed: int, epoch: int) -> torch.Generator:
    # Mix seed and epoch so (seed, epoch) pairs never collide for realistic values.
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63 - 1))


class BatchPlan:
    """Splits example indices into micro-batches, anew for every epoch."""

    def __init__(self, lengths: list[int], micro_batch_size: int, seed: int, kind: str = "random",
                 max_length: int | None = None, mixture=None):
        if kind not in ("random", "length_grouped", "packed"):
            raise ValueError(f"unknown sampler {kind!r}")
        self.lengths = lengths
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.kind = kind
        # gpupoor.data.mixture.Mixture: which examples an epoch holds (None or plain: each example once).
        self.mixture = None if mixture is None or mixture.is_plain() else mixture
        # packed: examples are bin-packed into rows of at most max_length tokens, micro_batch_size rows per
        # micro-batch. Rows, not one long row: attention costs length^2, and a 4096-token row of 30 short
        # examples (block-diagonal masks on CPU/SDPA are dense) costs 8x the work of 8 rows of 512.
        self.row_length = max_length or max(lengths, default=1)
        examples = sum(source.count for source in self.mixture.sources) if self.mixture else len(lengths)
        self._count = len(self.epoch(0)) if kind == "packed" else -(-examples // micro_batch_size)

    def __len__(self) -> int:
        """Micro-batches per epoch (the last one may be smaller). For packing, the count of epoch 0: other
        epochs differ by a bin or two, which only moves the epoch fraction that metrics report."""
        return self._count

    def epoch(self, epoch: int) -> list[list[int]]:
        generator = _generator(self.seed, epoch)
        if self.mixture is not None:
            order = self.mixture.draw(epoch, generator)
        else:
            order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size = self.micro_batch_size
        if self.kind == "random":
            return [order[i:i + size] for i in range(0, len(order), size)]
        if self.kind == "packed":
            rows = []
            for start in range(0, len(order), PACK_WINDOW):
                rows += first_fit_decreasing(order[start:start + PACK_WINDOW], self.lengths, self.row_length)
            shuffled = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            # A micro-batch: micro_batch_size rows, flattened (collate packs them into rows again).
            return [[i for row in shuffled[j:j + size] for i in row] for j in range(0, len(shuffled), size)]
        window = size * MEGABATCH_FACTOR
        batches = []
        for start in range(0, len(order), window):
            group = sorted(order[start:start + window], key=lambda i: -self.lengths[i])
            batches += [group[i:i + size] for i in range(0, len(group), size)]
        # Shuffle the batch order so long batches do not all come first.
        shuffled = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in shuffled]

def first_fit_decreasing(indices: list[int], lengths, capacity: int) -> list[list[int]]:
    """Whole examples into bins of at most `capacity` tokens: longest first, each into the first bin with
    room. Ties keep the given order, so a shuffled input gives a result that is a function of the shuffle."""
    free: list[int] = []
    bins: list[list[int]] = []
    for index in sorted(indices, key=lambda i: -lengths[i]):
        length = lengths[index]
        for slot, room in enumerate(free):
            if length <= room:
                bins[slot].append(index)
                free[slot] -= length
                break
        else:
            bins.append([index])
            free.append(capacity - length)
    return bins
