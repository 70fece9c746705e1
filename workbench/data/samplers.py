"""Training samplers whose order depends only on (seed, epoch) -- and the lengths they sort by.

An order that is a pure function of the seed, the epoch number and (for the length-aware
samplers) the sample lengths is what makes resume exact: a resumed run re-creates the
epoch's order and skips what was consumed, and every process of a distributed run computes
the same order before Accelerate shards it.

Strategies (``train_sampling_strategy``):

* ``random``: :class:`EpochRandomSampler`, a permutation drawn from ``seed + epoch``.
* ``sequential``: :class:`EpochSequentialSampler`.
* ``group_by_length``: :class:`LengthGroupedSampler`, a random permutation cut into
  "mega-batches" that are each sorted by length, so a batch holds samples of similar length.
* ``batch_rebalance``: :class:`BatchRebalanceSampler`, a *batch* sampler that, per optimizer
  step, sorts the step's samples by length and splits them across processes and
  micro-batches so each micro-batch carries about the same padded-token cost.

How ``batch_rebalance`` meets Accelerate's sharding: ``accelerator.prepare`` wraps a
DataLoader's batch sampler in ``BatchSamplerShard``, which hands global batch ``i`` to
process ``i % num_processes`` (no ``batch_size`` attribute means "batches may differ in size",
so nothing is dropped or re-cut). The sampler therefore yields, for each step, its
``num_processes * gradient_accumulation_steps`` micro-batches in the order
``(micro 0: rank 0, rank 1, ...), (micro 1: rank 0, rank 1, ...), ...``; every rank then
receives exactly its ``gradient_accumulation_steps`` micro-batches of the step, in order, and
an epoch always holds a multiple of ``num_processes`` micro-batches so Accelerate never
has to loop back to pad a rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from workbench.core.rng import CollationRng, draws_random

__all__ = [
    "BatchRebalanceSampler",
    "EpochRandomSampler",
    "EpochSequentialSampler",
    "LengthGroupedSampler",
    "SAMPLING_STRATEGIES",
    "dataset_lengths",
    "draw_iterator_seed",
    "loader_samplers",
    "padded_cost",
    "start_loader_epoch",
    "track_collation",
]

SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length", "batch_rebalance")


def _permutation(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=generator).tolist()


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
        return iter(_permutation(len(self.data_source), self.seed + self.epoch))

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


# -- lengths ------------------------------------------------------------------------------


def _is_hf_dataset(dataset: Any) -> bool:
    # Checked by module name so this file never imports ``datasets`` itself.
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "column_names")


def dataset_lengths(dataset: Any, length_column_name: str = "length",
                    model_input_name: str = "input_ids") -> list[int]:
    """The length of every sample, for the length-aware samplers (read once per run).

    A precomputed ``length_column_name`` column of a ``datasets.Dataset`` is used as is (the
    cheap path, as in HF); otherwise the length is that of each sample's first model input
    ``model_input_name`` -- read column-wise through Arrow for a ``datasets.Dataset``, item
    by item for any other map-style dataset of dicts.
    """
    if _is_hf_dataset(dataset):
        columns = dataset.column_names
        if length_column_name in columns:
            return [int(v) for v in dataset.with_format("arrow")[length_column_name].to_pylist()]
        if model_input_name not in columns:
            raise ValueError(
                f"cannot compute sample lengths: the dataset has neither a {length_column_name!r} column "
                f"(length_column_name) nor a {model_input_name!r} column; columns: {', '.join(columns)}"
            )
        import pyarrow.compute as pc

        return [int(v) for v in pc.list_value_length(dataset.with_format("arrow")[model_input_name]).to_pylist()]
    n = len(dataset)
    if n == 0:
        return []
    first = dataset[0]
    if not hasattr(first, "keys") or model_input_name not in first:
        kind = f"dict items without {model_input_name!r}" if hasattr(first, "keys") else f"{type(first).__name__} items"
        raise ValueError(
            f"cannot compute sample lengths for a dataset of {kind}; add a {length_column_name!r} column "
            f"or items with a {model_input_name!r} key"
        )
    if length_column_name in first:
        return [int(dataset[i][length_column_name]) for i in range(n)]
    return [len(dataset[i][model_input_name]) for i in range(n)]


def padded_cost(batch: Sequence[int], lengths: Sequence[int]) -> int:
    """Tokens a right-padded micro-batch of ``batch`` occupies: count x longest sample."""
    return len(batch) * max((lengths[i] for i in batch), default=0)


# -- group_by_length -------------------------------------------------------------------------


class LengthGroupedSampler(Sampler[int]):
    """Indices in random order, grouped so each batch holds samples of similar length.

    As HF's: the epoch's permutation (from ``seed + epoch``) is cut into mega-batches of
    ``mega_batch_mult * batch_size`` samples (``mega_batch_mult`` defaults to
    ``min(n // (4 * batch_size), 50)``, at least 1); each mega-batch is sorted by length,
    longest first, and the longest sample of the epoch is moved to the very front so an
    out-of-memory error shows on the first step rather than hours in.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0,
                 mega_batch_mult: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.mega_batch_mult = mega_batch_mult
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order for ``epoch`` (call before iterating)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        n = len(self.lengths)
        if n == 0:
            return iter(())
        mult = self.mega_batch_mult or max(min(n // (self.batch_size * 4), 50), 1)
        size = mult * self.batch_size
        perm = _permutation(n, self.seed + self.epoch)
        lengths = self.lengths
        groups = [sorted(perm[i:i + size], key=lambda j: -lengths[j]) for i in range(0, n, size)]
        # Each group's head is its longest sample: bring the overall longest to the front.
        longest = max(range(len(groups)), key=lambda g: lengths[groups[g][0]])
        groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
        return iter([i for group in groups for i in group])


# -- batch_rebalance -------------------------------------------------------------------------


def _runs_needed(heads: list[int], cap: int) -> int:
    """Runs a greedy left-to-right fill needs when no run may cost more than ``cap``."""
    n, start, runs = len(heads), 0, 0
    while start < n:
        start += max(cap // heads[start], 1)  # the head is the run's longest sample
        runs += 1
    return runs


def _split_sorted(order: list[int], lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Cut ``order`` (sorted longest first) into ``parts`` non-empty runs of balanced padded cost.

    A run's padded cost is its size times its first (longest) sample. First the smallest
    possible maximum run cost is found (binary search on the cap; a greedy fill decides if a
    cap fits in ``parts`` runs), which is optimal: some optimal grouping always takes runs of
    the sorted order. Then neighbouring runs trade boundary samples while that narrows their
    gap without raising the larger of the two, so short samples do not all pile into one
    cheap left-over run.
    """
    heads = [max(lengths[i], 1) for i in order]
    n = len(order)
    low, high = heads[0], math.ceil(n / parts) * heads[0]  # equal counts always fit under high
    while low < high:
        mid = (low + high) // 2
        if _runs_needed(heads, mid) <= parts:
            high = mid
        else:
            low = mid + 1
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(min(bounds[-1] + max(low // heads[bounds[-1]], 1), n))
    while len(bounds) - 1 < parts:  # fewer runs than parts: halve the largest run
        sizes = [bounds[k + 1] - bounds[k] for k in range(len(bounds) - 1)]
        k = max(range(len(sizes)), key=lambda k: sizes[k])
        bounds.insert(k + 1, bounds[k] + sizes[k] // 2)

    def cost(k: int) -> int:
        return (bounds[k + 1] - bounds[k]) * heads[bounds[k]]

    for _ in range(parts):  # smoothing sweeps; each move strictly improves a pair
        moved = False
        for k in range(parts - 1, 0, -1):
            while bounds[k] - bounds[k - 1] > 1:
                before = (max(cost(k - 1), cost(k)), abs(cost(k - 1) - cost(k)))
                bounds[k] -= 1  # the shortest sample of run k-1 becomes the head of run k
                after = (max(cost(k - 1), cost(k)), abs(cost(k - 1) - cost(k)))
                if after < before:
                    moved = True
                else:
                    bounds[k] += 1
                    break
        if not moved:
            break
    return [order[bounds[k]:bounds[k + 1]] for k in range(parts)]


class BatchRebalanceSampler(Sampler[list[int]]):
    """A batch sampler that balances padded-token cost across processes and micro-batches.

    Per optimizer step it takes the next ``num_processes * gradient_accumulation_steps *
    batch_size`` samples of the epoch's permutation (from ``seed + epoch``), sorts them by
    length and cuts them into ``num_processes * gradient_accumulation_steps`` micro-batches of
    about equal padded cost -- long samples in small micro-batches, short ones in large --
    so ``batch_size`` (``per_device_train_batch_size``) is the *average* micro-batch size and a
    step trains on as many samples as with the other strategies. The micro-batches are dealt
    to ranks costliest first, each to the rank with the smallest total so far, so each rank's
    step total is balanced too, and yielded in the
    order Accelerate's ``BatchSamplerShard`` needs (see the module docstring).

    The last step of an epoch may be short: it gets fewer micro-batches per rank (the loop
    then steps with what it has). With ``drop_last`` the samples that do not fill a
    ``num_processes * batch_size`` round are dropped; without it, an epoch with fewer left-over
    samples than processes repeats samples from the epoch's start so every rank gets one.
    """

    batch_size = None  # micro-batches differ in size: tells Accelerate not to re-cut them

    def __init__(self, lengths: Sequence[int], batch_size: int, num_processes: int = 1,
                 gradient_accumulation_steps: int = 1, seed: int = 0, drop_last: bool = False) -> None:
        for name, value in (("batch_size", batch_size), ("num_processes", num_processes),
                            ("gradient_accumulation_steps", gradient_accumulation_steps)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.lengths = list(lengths)
        self.average_batch_size = batch_size
        self.num_processes = num_processes
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order for ``epoch`` (call before iterating)."""
        self.epoch = epoch

    @property
    def step_size(self) -> int:
        """Samples per optimizer step over all processes."""
        return self.num_processes * self.gradient_accumulation_steps * self.average_batch_size

    def _last_rounds(self, rest: int) -> int:
        """Micro-batches per rank in the epoch's final, partial step of ``rest`` samples."""
        if rest == 0:
            return 0
        per_round = self.num_processes * self.average_batch_size
        if self.drop_last:
            return rest // per_round
        rounds = math.ceil(rest / per_round)
        return max(1, min(rounds, rest // self.num_processes))

    def __len__(self) -> int:
        n = len(self.lengths)
        full, rest = divmod(n, self.step_size)
        rounds = full * self.gradient_accumulation_steps + self._last_rounds(rest)
        return rounds * self.num_processes

    def step_plan(self, samples: list[int], rounds: int) -> list[list[list[int]]]:
        """``plan[micro][rank]``: the step's ``samples`` cut and dealt to ``rounds`` x ranks."""
        procs = self.num_processes
        lengths = self.lengths
        order = sorted(samples, key=lambda i: -lengths[i])  # stable: ties keep the random order
        runs = _split_sorted(order, lengths, rounds * procs)
        runs.sort(key=lambda run: -padded_cost(run, lengths))
        # Costliest first, each to the rank with the smallest total that still has room.
        per_rank: list[list[list[int]]] = [[] for _ in range(procs)]
        totals = [0] * procs
        for run in runs:
            rank = min((r for r in range(procs) if len(per_rank[r]) < rounds), key=lambda r: totals[r])
            per_rank[rank].append(run)
            totals[rank] += padded_cost(run, lengths)
        return [[per_rank[rank][micro] for rank in range(procs)] for micro in range(rounds)]

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.lengths)
        if n == 0:
            return
        perm = _permutation(n, self.seed + self.epoch)
        size = self.step_size
        for start in range(0, n, size):
            samples = perm[start:start + size]
            rounds = self.gradient_accumulation_steps
            if len(samples) < size:
                rounds = self._last_rounds(len(samples))
                if rounds == 0:
                    return
                if self.drop_last:
                    samples = samples[:rounds * self.num_processes * self.average_batch_size]
                elif len(samples) < self.num_processes:  # too few for one sample per rank
                    samples = samples + [perm[i % n] for i in range(self.num_processes - len(samples))]
            for micro in self.step_plan(samples, rounds):
                yield from micro


def loader_samplers(loader: Any) -> list[Any]:
    """The samplers and batch samplers inside ``loader``, outermost first, each once.

    Followed through the ``sampler`` / ``batch_sampler`` attributes, so the sampler a
    DataLoader was built with is found behind torch's ``BatchSampler`` and Accelerate's
    ``BatchSamplerShard`` / ``SkipBatchSampler`` wrappers alike, whoever built the loader.
    """
    found: list[Any] = []
    seen: set[int] = set()
    pending = [getattr(loader, name, None) for name in ("batch_sampler", "sampler")]
    while pending:
        item = pending.pop(0)
        if item is None or id(item) in seen or item is loader:
            continue
        seen.add(id(item))
        found.append(item)
        pending.extend(getattr(item, name, None) for name in ("batch_sampler", "sampler"))
    return found


def start_loader_epoch(loader: Any, epoch: int, seed: int) -> None:
    """Make ``loader``'s next pass epoch ``epoch``'s order, derived from the loader alone.

    Everything is reached through the loader (not through state its builder left on the
    Trainer), so a ``get_train_dataloader`` override keeps per-epoch seeding: the loader's and
    every inner sampler's ``set_epoch``, its collator's ``set_epoch`` (seeded MLM masking),
    and its ``generator`` re-seeded with ``seed + epoch`` (the worker base seeds are drawn
    from it, so an iterator started mid-run, on resume, draws what the original run drew).
    Called once per epoch, never per step.
    """
    if hasattr(loader, "set_epoch"):  # Accelerate's loaders (and an IterableDataset behind them)
        loader.set_epoch(epoch)
    for sampler in loader_samplers(loader):
        if hasattr(sampler, "set_epoch"):  # idempotent: Accelerate may have reached it already
            sampler.set_epoch(epoch)
    collator = getattr(loader, "collate_fn", None)
    if hasattr(collator, "set_epoch"):
        collator.set_epoch(epoch)
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(seed + epoch)


def draw_iterator_seed(loader: Any, epoch: int) -> None:
    """Consume the global-RNG draw transformers' train loader makes as an epoch starts.

    A DataLoader without a generator of its own draws its workers' base seed from the global
    torch RNG each time an iterator starts (one int64); transformers' loaders have none, so
    in an HF run dropout and random masking see the numbers after that draw. workbench's
    loader owns a generator (a resumed run's workers start as the uninterrupted run's did)
    and draws the same number here instead, so a seeded run sees HF's random numbers. Called
    at an epoch's first batch only: a run resumed mid-epoch took its RNG state from a
    checkpoint written after the draw. With persistent workers torch keeps its first
    iterator, so only epoch 0 draws, as HF's uninterrupted run does. A loader without a
    generator (an override's) draws by itself.
    """
    if not isinstance(getattr(loader, "generator", None), torch.Generator):
        return
    if epoch > 0 and getattr(loader, "num_workers", 0) > 0 and getattr(loader, "persistent_workers", False):
        return
    torch.empty((), dtype=torch.int64).random_()


def track_collation(loader: Any, accumulation: int) -> CollationRng | None:
    """Remember the random streams each batch is collated from, where collation may draw from
    them in this process (core/rng.py's CollationRng says why a checkpoint needs them);
    None where it cannot (workers collate elsewhere, or the collator draws nothing)."""
    collate = getattr(loader, "collate_fn", None)
    if isinstance(collate, CollationRng):
        collate.restart()
        return collate
    if collate is None or getattr(loader, "num_workers", 0) > 0 or not draws_random(collate):
        return None
    # At most a step's micro-batches plus the one collated ahead wait untrained.
    tracked = CollationRng(collate, keep=accumulation + 1)
    # Accelerate's loaders read the collator of the DataLoader they wrap (and copy it into
    # the loader skip_first_batches builds).
    getattr(loader, "base_dataloader", loader).collate_fn = tracked
    return tracked
