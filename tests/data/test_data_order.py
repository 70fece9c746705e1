"""DataOrder (workbench/guard/samples.py): the dataset rows at loop positions, recomputed from
the epoch's deterministic order, for one process and for each rank of a sharded loader."""

from __future__ import annotations

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from workbench.data.samplers import BatchRebalanceSampler, EpochRandomSampler
from workbench.guard.samples import DataOrder

ROWS = list(range(30))


def epoch_batches(batch_sampler, sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return [list(b) for b in batch_sampler]


def test_one_process_rows_match_the_epoch_order_and_leave_the_sampler_alone():
    sampler = EpochRandomSampler(ROWS, seed=5)
    loader = DataLoader(ROWS, batch_size=4, sampler=sampler)
    expected = epoch_batches(BatchSampler(EpochRandomSampler(ROWS, seed=5), 4, False),
                             EpochRandomSampler(ROWS, seed=5), 0)
    fresh = EpochRandomSampler(ROWS, seed=5)
    second = epoch_batches(BatchSampler(fresh, 4, False), fresh, 1)
    sampler.set_epoch(1)
    order = DataOrder(loader, len(loader))
    assert order.known and order.num_ranks == 1
    assert order.samples(1, 2, 3) == [second[2] + second[3]]
    assert sampler.epoch == 1
    # a span runs into the next epoch: the last two batches of epoch 1, then epoch 2's first
    fresh.set_epoch(2)
    third = [list(b) for b in BatchSampler(fresh, 4, False)]
    assert order.span((1, 6), 3) == [second[6] + second[7] + third[0]]
    assert sampler.epoch == 1
    assert expected != second  # the epochs' orders differ, so the epoch was honoured


def _rebalance():
    return BatchRebalanceSampler([1 + i % 7 for i in ROWS], 3, num_processes=2, seed=2)


def _random_batches():
    return BatchSampler(EpochRandomSampler(ROWS, seed=2), 4, False)  # 8 batches, the last one short


@pytest.mark.parametrize("make", [_rebalance, _random_batches], ids=["batch_rebalance", "random"])
def test_each_rank_of_a_sharded_loader(make):
    shard = BatchSamplerShard(make(), num_processes=2, process_index=0)
    loader = DataLoader(ROWS, batch_sampler=shard)
    order = DataOrder(loader, len(loader))
    assert order.known and order.num_ranks == 2
    last = len(loader) - 1  # the end of the epoch too, where Accelerate evens the ranks out
    per_rank, tail = order.samples(0, 1, 2), order.samples(0, last, last)
    for rank in (0, 1):
        batches = [list(b) for b in BatchSamplerShard(make(), num_processes=2, process_index=rank)]
        assert per_rank[rank] == batches[1] + batches[2]
        assert tail[rank] == batches[last]
    assert per_rank[0] != per_rank[1]
    assert shard.process_index == 0  # the live shard is untouched


def test_an_order_not_set_by_the_epoch_is_unknown():
    loader = DataLoader(ROWS, batch_size=4, sampler=RandomSampler(ROWS))
    order = DataOrder(loader, len(loader))
    assert not order.known and order.samples(0, 0, 0) is None and order.span((0, 0), 2) is None
