"""Which dataset rows a training loader hands out at given positions of an epoch.

The guard (issue #18) names the samples of a bad step, and those a rollback jumps over.
Recording them as the batches are drawn would cost every step something (and the
DataLoader draws indices ahead of the step, through prefetching and workers); instead they
are recomputed here, only when an intervention is recorded, from the epoch's order, which
is a pure function of the seed and the epoch for workbench's samplers (samplers.py).

Positions are the loop's: (epoch, micro-batch of this process). With several processes,
Accelerate's ``BatchSamplerShard`` deals the global batches to the ranks; each rank's share
is recomputed with a copy of that shard for each process index, so every process knows
every rank's samples without any communication.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch.utils.data import BatchSampler, SequentialSampler

from workbench.data.samplers import loader_samplers

__all__ = ["DataOrder"]


def _pure_wrappers() -> tuple[type, ...]:
    """Batch samplers whose output depends only on the sampler they wrap."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler

    return BatchSampler, SequentialSampler, BatchSamplerShard, SkipBatchSampler


class DataOrder:
    """Dataset indices at (epoch, micro-batch) positions of ``loader``, per rank.

    ``known`` is False when the order cannot be recomputed: an iterable dataset (no indices),
    or a sampler whose order is not set by ``set_epoch`` (e.g. torch's ``RandomSampler``,
    which draws from a generator's running state); the callers then record no sample ids.
    """

    def __init__(self, loader: Any, batches_per_epoch: int | None) -> None:
        self.loader = loader
        self.batches_per_epoch = batches_per_epoch
        self.batch_sampler = getattr(loader, "batch_sampler", None)
        samplers = loader_samplers(loader) if self.batch_sampler is not None else []
        wrappers = _pure_wrappers()
        self._epoch_samplers = [s for s in samplers if hasattr(s, "set_epoch")]
        self.known = bool(samplers) and all(
            isinstance(s, wrappers) or (hasattr(s, "set_epoch") and hasattr(s, "epoch")) for s in samplers)
        # Accelerate puts its shard outermost; one nested deeper would be bypassed by the
        # per-rank copies, so its order is treated as unknown.
        shard_type = wrappers[2]
        self._shard = self.batch_sampler if isinstance(self.batch_sampler, shard_type) else None
        if self._shard is None and any(isinstance(s, shard_type) for s in samplers):
            self.known = False

    @property
    def num_ranks(self) -> int:
        return self._shard.num_processes if self._shard is not None else 1

    def samples(self, epoch: int, first: int, last: int) -> list[list[int]] | None:
        """Each rank's dataset indices in micro-batches ``first..last`` of ``epoch`` (None when
        the order is not known)."""
        if not self.known:
            return None
        return self._read(epoch, first, last + 1)

    def span(self, start: tuple[int, int], count: int) -> list[list[int]] | None:
        """Each rank's indices in ``count`` micro-batches from ``start``, into later epochs
        when the span runs past one (None when the order is not known)."""
        if not self.known:
            return None
        per_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
        epoch, batch = start
        while count > 0:
            end = batch + count
            if self.batches_per_epoch:
                end = min(end, self.batches_per_epoch)
            for rank, ids in enumerate(self._read(epoch, batch, end)):
                per_rank[rank].extend(ids)
            count -= end - batch
            epoch, batch = epoch + 1, 0
        return per_rank

    def _read(self, epoch: int, first: int, stop: int) -> list[list[int]]:
        """Each rank's indices in micro-batches ``first`` to ``stop - 1`` of ``epoch``.

        The live samplers are set to ``epoch`` and set back after: the running epoch's
        iterators drew their order when they started, so they are not disturbed; the global
        RNG is forked in case a sampler draws from it.
        """
        previous = [(s, s.epoch) for s in self._epoch_samplers]
        try:
            with torch.random.fork_rng(devices=[]):
                for sampler in self._epoch_samplers:
                    sampler.set_epoch(epoch)
                out = []
                for rank in range(self.num_ranks):
                    batches = itertools.islice(iter(self._rank_sampler(rank)), first, stop)
                    out.append([int(i) for batch in batches for i in batch])
                return out
        finally:
            for sampler, epoch_before in previous:
                sampler.set_epoch(epoch_before)

    def _rank_sampler(self, rank: int) -> Any:
        """The batch sampler of process ``rank`` (this process's own when not sharded)."""
        if self._shard is None:
            return self.batch_sampler
        shard = copy.copy(self._shard)
        shard.process_index = rank
        return shard
