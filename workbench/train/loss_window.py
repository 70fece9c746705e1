"""The training loss between two logging points, kept on the device at no per-step cost.

Each micro-batch's loss tensor is only *remembered* (a list append: no kernel, no host
sync). At a logging point the window is reduced in a few vectorized kernels, with HF's
``logging_nan_inf_filter`` rule applied exactly: a non-finite loss counts as the running
sum so far divided by (1 + steps so far in the window), i.e. the running sum grows by the
factor ``1 + 1/(k + 1)`` instead of by the loss. As a formula over the window:

    total = S0 * prod(m) + sum_i finite_i * v_i * prod_{j > i} m_j,
    m_j = 1 + 1/(k_j + 1) where v_j is not finite, else 1.

Long windows (logging every few thousand steps, or never) are folded into ``S0`` every
``FOLD`` entries, still on the device.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LossWindow"]

FOLD = 1024


class LossWindow:
    """Per-step training losses since the last log, reduced only when read."""

    def __init__(self, device: torch.device, nan_inf_filter: bool) -> None:
        self.filter = nan_inf_filter
        self.device = device
        self._folded = torch.zeros((), device=device)
        self._losses: list[torch.Tensor] = []
        self._steps: list[int] = []  # steps already in the window when each loss came

    def add(self, loss: torch.Tensor, steps_before: int) -> None:
        """Remember one micro-batch loss (``steps_before``: finished steps in this window)."""
        self._losses.append(loss)
        self._steps.append(steps_before)
        if len(self._losses) >= FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._losses:
            return
        values = torch.stack(self._losses).to(self._folded.dtype)
        if not self.filter:
            self._folded = self._folded + values.sum()
        else:
            finite = torch.isfinite(values)
            steps = torch.tensor(self._steps, device=values.device, dtype=values.dtype)
            factor = torch.where(finite, torch.ones_like(values), 1 + 1 / (steps + 1))
            # after[i] = product of the factors of the entries after i
            after = torch.cat([torch.flip(torch.cumprod(torch.flip(factor[1:], [0]), 0), [0]),
                               torch.ones(1, device=values.device, dtype=values.dtype)])
            self._folded = self._folded * factor.prod() + (torch.where(finite, values, 0) * after).sum()
        self._losses.clear()
        self._steps.clear()

    def total(self) -> torch.Tensor:
        """The window's (filtered) loss sum as a 0-d device tensor."""
        self._fold()
        return self._folded

    def reset(self) -> None:
        """Start a new window (after a log)."""
        self._folded = torch.zeros((), device=self.device)
        self._losses.clear()
        self._steps.clear()

    def __bool__(self) -> bool:
        return bool(self._losses)

    def export(self) -> dict[str, Any]:
        """The window as plain numbers, for a checkpoint (a host sync: saves are sync points).

        The entries are kept one by one, not summed, so a resumed run reduces exactly the
        same values in the same order as an uninterrupted one: its next logged loss is equal.
        """
        dtype = self._losses[0].dtype if self._losses else self._folded.dtype
        return {"folded": float(self._folded), "losses": [float(v) for v in self._losses],
                "steps": list(self._steps), "dtype": str(dtype).removeprefix("torch.")}

    def restore(self, saved: dict[str, Any]) -> None:
        """Put back what :meth:`export` wrote (the same dtypes, so the reductions match)."""
        dtype = getattr(torch, saved.get("dtype", "float32"), torch.float32)
        self._folded = torch.tensor(saved.get("folded", 0.0), dtype=self._folded.dtype, device=self.device)
        self._losses = [torch.tensor(v, dtype=dtype, device=self.device) for v in saved.get("losses", [])]
        self._steps = [int(k) for k in saved.get("steps", [])]
