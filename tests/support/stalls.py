"""A data loader that stands still once: the hang the health watchdog must find."""

from __future__ import annotations

import time

import torch


class StuckOnce:
    """A collator that stacks a batch, standing still for ``seconds`` at its ``at``-th batch."""

    def __init__(self, at: int, seconds: float) -> None:
        self.at, self.seconds, self.calls = at, seconds, 0

    def __call__(self, rows):
        self.calls += 1
        if self.calls == self.at:
            time.sleep(self.seconds)
        return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}
