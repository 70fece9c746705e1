"""The training loss between two logging points, kept on the device at no per-step cost, and
the run's loss log built on it (``LossLog``: what is logged, HF's ``train_loss``, and what a
checkpoint carries).

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

import copy
from typing import Any

import torch

from workbench.core.run import Run

__all__ = ["LossWindow", "LossLog"]

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

    def peek(self) -> torch.Tensor:
        """:meth:`total` leaving the entries unfolded: a restored window must reduce them
        together with the ones still to come, in one sum as the uninterrupted run does (a sum
        folded early can differ in the last bit)."""
        kept = self._folded, list(self._losses), list(self._steps)
        total = self.total()
        self._folded, self._losses, self._steps = kept
        return total

    def reset(self) -> None:
        """Start a new window (after a log)."""
        self._folded = torch.zeros((), device=self.device)
        self._losses.clear()
        self._steps.clear()

    def __bool__(self) -> bool:
        return bool(self._losses)

    def copy(self) -> "LossWindow":
        """An independent window holding the same losses (the tensors are shared: never changed
        in place)."""
        other = copy.copy(self)
        other._losses, other._steps = list(self._losses), list(self._steps)
        return other

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


class LossLog:
    """The training loss of one ``train()`` call: the window since the last log (device-side,
    ``LossWindow``), the running total HF's ``train_loss`` divides, and what a checkpoint
    carries of it so a resumed run logs exactly what the uninterrupted one logs."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.window = LossWindow(run.accelerator.device, run.args.logging_nan_inf_filter)
        self.total = 0.0
        self.last_logged = run.state.global_step
        self.grad_norm: torch.Tensor | None = None
        # The rate the last optimizer step used, read before the schedule moves on: what HF
        # logs for that step (None until a step of this call ran).
        self.learning_rate: float | None = None

    def add(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss, remembered (not added: the window sums and filters it at
        the logging point)."""
        self.window.add(loss, self.run.state.global_step - self.last_logged)

    def copy(self) -> "LossLog":
        """An independent loss log in the same state (a fork's variant saved on purpose counts its
        steps into a copy, leaving the run's own untouched)."""
        other = copy.copy(self)
        other.window = self.window.copy()
        return other

    def skip_log(self) -> None:
        """A logging point whose record is not wanted (a saved variant's, train/fork_save.py):
        the window starts anew as after a log."""
        self.window.reset()
        self.last_logged = self.run.state.global_step

    def restart_at(self, step: int) -> None:
        """A rollback undid steps: the unlogged losses are partly theirs; drop them and count
        from the restored step."""
        self.window.reset()
        self.last_logged = step

    def log(self, start_time: float, learning_rate: float | None = None) -> dict[str, float] | None:
        """The loss since the last log (a host sync: a logging point) with the gradient norm and
        the learning rate the last step used (``learning_rate``; else the current one); None
        when no step ran since. The mean over ranks (Accelerate's gather is the tensor itself
        with one process)."""
        run, acc, state = self.run, self.run.accelerator, self.run.state
        if state.global_step <= self.last_logged:
            return None
        loss_scalar = acc.gather(self.window.total().reshape(1)).mean().item()  # host sync: logging point
        self.window.reset()
        logs: dict[str, float] = {"loss": loss_scalar / (state.global_step - self.last_logged)}
        if self.grad_norm is not None:
            logs["grad_norm"] = float(self.grad_norm)
        logs["learning_rate"] = learning_rate if learning_rate is not None else run._get_learning_rate()
        self.total += loss_scalar
        self.last_logged = state.global_step
        return logs

    def train_loss(self, steps_run: int) -> float:
        """HF's ``train_loss``: every step's loss of this call, the unlogged ones folded in."""
        if self.run.state.global_step > self.last_logged:
            self.total += self.window.total().item()
        return self.total / max(steps_run, 1)

    def export(self) -> dict[str, Any]:
        """The loss not logged yet, for a checkpoint. One process keeps the entries themselves
        (a resumed run reduces exactly the same values); with several (a collective: every
        rank saves) the ranks' sums are averaged as at a logging point, and every rank carries
        that mean, so the next log's mean over ranks comes out the same."""
        acc = self.run.accelerator
        if acc.num_processes == 1:
            saved = self.window.export()
        else:
            mean = float(acc.gather(self.window.total().reshape(1)).mean())
            saved = {"folded": mean, "losses": [], "steps": [], "dtype": "float32"}
        return {**saved, "since_step": self.last_logged}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continue the window a checkpoint carried; train_loss stays over this run's steps (HF)."""
        state = self.run.state
        if not saved or saved.get("since_step") is None or not 0 <= saved["since_step"] <= state.global_step:
            return
        self.window.restore(saved)
        self.last_logged = int(saved["since_step"])
        # The first log after the resume adds the carried loss to the total: start below zero.
        self.total = -float(self.run.accelerator.gather(self.window.peek().reshape(1)).mean())
