"""Mixtures: several sources in one training set, each drawn in its own amount every epoch.

The sources' examples sit end to end in one dataset (source i owns indices [start_i, end_i)). The examples of
an epoch are a pure function of (seed, epoch): each source contributes `count_i` examples, drawn from
seeded permutations of its own examples (a count above its size takes a fresh permutation for every extra
pass), and the epoch's order is a seeded shuffle of them all. A position in the data stays (epoch,
micro-batches consumed), so a run resumes in the middle of a mixture in O(1), exactly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass
class Source:
    name: str
    start: int  # first index of its examples in the combined training set
    end: int
    count: int  # examples drawn from it per epoch
    eval_start: int = 0  # its examples in the combined eval set (empty range: no eval of its own)
    eval_end: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start


def source_counts(sizes: list[int], weights: list[float | None], rows: list[int | None],
                  epochs: list[float | None]) -> list[int]:
    """Examples per epoch of each source: by weight (shares of all sources' examples together), by an exact row
    count, by passes over the source, or one pass."""
    if all(weight is not None for weight in weights):
        total, weight_sum = sum(sizes), sum(weights)
        return [max(1, round(total * weight / weight_sum)) for weight in weights]
    return [row if row is not None else max(1, round(size * (epoch if epoch is not None else 1.0)))
            for size, row, epoch in zip(sizes, rows, epochs)]


class Mixture:
    """Which examples each epoch holds, and which source an index belongs to."""

    def __init__(self, sources: list[Source], seed: int):
        self.sources, self.seed = sources, seed
        self._starts = [source.start for source in sources]

    @property
    def names(self) -> list[str]:
        return [source.name for source in self.sources]

    def is_plain(self) -> bool:
        """One source drawn once per epoch: the epoch is a permutation of everything, as without a mixture."""
        return len(self.sources) == 1 and self.sources[0].count == self.sources[0].size

    def source_of(self, index: int) -> str:
        return self.sources[bisect.bisect_right(self._starts, index) - 1].name

    def draw(self, epoch: int, generator: torch.Generator) -> list[int]:
        """The epoch's examples in order (an example may appear more than once when its source repeats)."""
        drawn: list[int] = []
        for number, source in enumerate(self.sources):
            passes = -(-source.count // max(source.size, 1))
            picked: list[int] = []
            for repeat in range(passes):
                own = torch.Generator().manual_seed(_mix(self.seed, epoch, number, repeat))
                picked += (torch.randperm(source.size, generator=own) + source.start).tolist()
            drawn += picked[: source.count]
        return [drawn[i] for i in torch.randperm(len(drawn), generator=generator).tolist()]


def _mix(*values: int) -> int:
    """One seed from several integers, without collisions for realistic values."""
    seed = 0
    for value in values:
        seed = (seed * 1_000_003 + value + 1) % (2**63 - 1)
    return seed
