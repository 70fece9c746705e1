"""Padding and speed of the sampling strategies on a skewed-length data set, side by side.

The same TinyGPT, data and optimizer train for one full epoch (so every strategy sees the
same tokens; group_by_length deliberately starts with its longest batches, which a fixed
step count would penalise) with train_sampling_strategy = random, group_by_length and
batch_rebalance (gradient accumulation on, so batch_rebalance has micro-batches to
balance), alternating within one invocation; the table reports the median over repeats:

* padding: the share of batch positions that are padding (attention_mask == 0);
* steps/s: optimizer steps per second of ``trainer.train()`` (CPU, one process), and the
  real (non-padding) tokens per second;
* rank imbalance: the mean over steps of max/min padded tokens per rank if the same
  order were sharded over 2 processes as Accelerate does (computed, not run).

Usage: python benchmarks/padding.py [--repeats R] [--samples N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from torch.utils.data import Dataset

from workbench import Trainer, TrainingArguments
from workbench.data.collators import DataCollatorForLanguageModeling
from workbench.data.builtin import CharTokenizer
from workbench.models import TinyGPT
from workbench.data.samplers import BatchRebalanceSampler, padded_cost

STRATEGIES = ("random", "group_by_length", "batch_rebalance")
BATCH, ACCUMULATION, MAX_LEN = 8, 4, 256


class SkewedRows(Dataset):
    """Token rows whose lengths follow a heavy tail: most short, a few near MAX_LEN."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.lengths = [min(MAX_LEN, max(8, int(8 * rng.paretovariate(1.1)))) for _ in range(n)]
        self.rows = [[rng.randint(2, 98) for _ in range(length)] for length in self.lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index]}


class CountingCollator:
    """The causal-LM collator, counting real and padded positions of every batch."""

    def __init__(self) -> None:
        self.inner = DataCollatorForLanguageModeling(CharTokenizer(), mlm=False)
        self.real = self.total = 0

    def __call__(self, features):
        batch = self.inner(features)
        self.real += int(batch["attention_mask"].sum())
        self.total += batch["attention_mask"].numel()
        return batch


def run(strategy: str, data: SkewedRows) -> tuple[float, float, float]:
    """(padding fraction, steps/s, real tokens/s) of one epoch of training."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=99, n_layer=2, n_head=4, n_embd=64, block_size=MAX_LEN)
    collator = CountingCollator()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, num_train_epochs=1, per_device_train_batch_size=BATCH,
                                 gradient_accumulation_steps=ACCUMULATION, train_sampling_strategy=strategy,
                                 learning_rate=1e-3, logging_steps=10_000, save_strategy="no", report_to="none",
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
        start = time.perf_counter()
        steps = trainer.train().global_step
        elapsed = time.perf_counter() - start
    return 1 - collator.real / collator.total, steps / elapsed, collator.real / elapsed


def rank_imbalance(strategy: str, data: SkewedRows, procs: int = 2) -> float:
    """Mean max/min padded tokens per rank and step, for ``procs`` ranks (computed)."""
    lengths = data.lengths
    per_step = procs * ACCUMULATION
    if strategy == "batch_rebalance":
        batches = list(BatchRebalanceSampler(lengths, BATCH, procs, ACCUMULATION, seed=0))
    else:
        trainer = Trainer(model=TinyGPT(vocab_size=99, n_layer=1, n_head=1, n_embd=8, block_size=MAX_LEN),
                          args=TrainingArguments(tempfile.gettempdir(), train_sampling_strategy=strategy,
                                                 per_device_train_batch_size=BATCH, report_to="none",
                                                 gradient_accumulation_steps=ACCUMULATION, disable_tqdm=True, seed=0),
                          train_dataset=data)
        order = list(trainer._get_train_sampler(data))
        batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    ratios = []
    for start in range(0, len(batches) - per_step + 1, per_step):
        step = batches[start:start + per_step]
        totals = [sum(padded_cost(b, lengths) for b in step[rank::procs]) for rank in range(procs)]
        ratios.append(max(totals) / min(totals))
    return statistics.mean(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=768)
    ns = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = SkewedRows(ns.samples)
    mean_len = sum(data.lengths) / len(data.lengths)
    print(f"{len(data)} samples, length {min(data.lengths)}..{max(data.lengths)} (mean {mean_len:.0f}); "
          f"batch {BATCH} x accumulation {ACCUMULATION}; one epoch x {ns.repeats} repeats")
    results: dict[str, list[tuple[float, float, float]]] = {s: [] for s in STRATEGIES}
    for _ in range(ns.repeats):
        for strategy in STRATEGIES:  # alternate, so machine noise hits every row alike
            results[strategy].append(run(strategy, data))
    base = statistics.median(r[1] for r in results["random"])
    print(f"{'strategy':<16} {'padding':>8} {'steps/s':>8} {'speed-up':>9} {'tokens/s':>9} "
          f"{'rank imbalance (2 ranks, computed)':>35}")
    for strategy in STRATEGIES:
        padding, speed, tokens = (statistics.median(r[k] for r in results[strategy]) for k in range(3))
        print(f"{strategy:<16} {padding:>7.1%} {speed:>8.2f} {speed / base:>8.2f}x {tokens:>9.0f} "
              f"{rank_imbalance(strategy, data):>34.2f}x")


if __name__ == "__main__":
    main()
