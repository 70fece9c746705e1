"""Time the training loop is blocked per checkpoint: synchronous vs ``save_async``, side by side.

A ~200 MB model (three 4096x4096 linear layers, fp32) trained with AdamW, so each
checkpoint holds ~600 MB (weights + two moment buffers). The loop saves every few
steps; we time each ``save_checkpoint`` call as the loop sees it (for ``save_async``: the
host copy, plus any wait for the previous write). Runs alternate within one invocation.

Usage: python benchmarks/checkpoint_save.py [--repeats R] [--saves S]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import workbench.checkpoint.trainer_state as checkpoints
from workbench import Trainer, TrainingArguments

WIDTH = 4096


class Wide(nn.Module):
    """Three wide layers: 50M parameters, ~200 MB in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                                    nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.layers(x), labels)}


class Noise(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(WIDTH, generator=g), "labels": torch.randn(WIDTH, generator=g)}


def one_run(save_async: bool, saves: int, every: int) -> tuple[list[float], float]:
    """(seconds the loop spent in each save, wall seconds of the run)."""
    blocked: list[float] = []
    original = checkpoints.save_checkpoint

    def timed(trainer):
        start = time.perf_counter()
        try:
            return original(trainer)
        finally:
            blocked.append(time.perf_counter() - start)

    out = tempfile.mkdtemp(prefix="workbench-save-bench-")
    torch.manual_seed(0)
    args = TrainingArguments(out, max_steps=saves * every, per_device_train_batch_size=4, save_steps=every,
                             save_total_limit=2, save_async=save_async, report_to="none", disable_tqdm=True,
                             logging_steps=1000)
    trainer = Trainer(model=Wide(), args=args, train_dataset=Noise())
    checkpoints.save_checkpoint = timed
    try:
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    finally:
        checkpoints.save_checkpoint = original
        shutil.rmtree(out, ignore_errors=True)
    return blocked, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=15, help="steps between saves")
    ns = parser.parse_args()
    rows: dict[str, list[float]] = {"sync": [], "async": []}
    walls: dict[str, list[float]] = {"sync": [], "async": []}
    for _ in range(ns.repeats):
        for mode in ("sync", "async"):
            blocked, wall = one_run(mode == "async", ns.saves, ns.every)
            rows[mode].extend(blocked)
            walls[mode].append(wall)
    sync, async_ = statistics.median(rows["sync"]), statistics.median(rows["async"])
    print(f"checkpoint of a {sum(p.numel() for p in Wide().parameters()) / 1e6:.0f}M-parameter model "
          f"(+ AdamW state), {ns.saves} saves x {ns.repeats} runs each")
    print(f"{'mode':<8} {'blocked per save (median)':>26} {'max':>8} {'run wall (median)':>18}")
    for mode in ("sync", "async"):
        print(f"{mode:<8} {statistics.median(rows[mode]) * 1000:>23.0f} ms {max(rows[mode]) * 1000:>5.0f} ms "
              f"{statistics.median(walls[mode]):>16.1f} s")
    print(f"async / sync blocked time: {async_ / sync:.2f}")


if __name__ == "__main__":
    main()
