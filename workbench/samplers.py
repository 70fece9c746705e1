"""Training samplers whose order depends only on (seed, epoch).

An order that is a pure function of the seed and the epoch number is what makes resume
exact: a resumed run re-creates the epoch's permutation and skips what was consumed, and
every process of a distributed run sees the same permutation before sharding.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

__all__ = ["EpochRandomSampler", "EpochSequentialSampler"]


class EpochRandomSampler(Sampler[int]):
    """A random permutation per epoch, drawn from ``seed + epoch``."""

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        self.data_source = data_source
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation for ``epoch`` (call before iterating)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=generator).tolist())

    def __len__(self) -> int:
        return len(self.data_source)


class EpochSequentialSampler(Sampler[int]):
    """Indices in order; ``set_epoch`` exists so every sampler takes the same calls."""

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """No-op: the order does not depend on the epoch."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)
