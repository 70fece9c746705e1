"""The guard's per-step checks, in the two places a step can be judged (issue #18).

Both classes answer the same questions with the same numbers: is this step's loss (or
gradient norm) non-finite, is its loss over ``spike_factor`` x the lower median of the last
``window`` accepted losses, and what does the host record for it later (a row of
``nonfinite, spike, loss, threshold``, float32 values). They keep the same detector state
(the ring of accepted losses, its position, the steps seen), so a checkpoint or snapshot
taken under one restores under the other.

- :class:`DeviceChecks`, for accelerators: every check is a small device op into
  preallocated tensors, a bad step's update is made a no-op on the device (fused Adam's
  ``found_inf``, or the pre-step values put back with ``torch.where``) and the host reads
  the rows only at points that synchronize anyway. Reading a flag on the host each step
  would stall the GPU queue every step.
- :class:`HostChecks`, for CPU runs: there the "device" is the host, a tensor's ``item()``
  waits for nothing, and the ~10 tensor ops above cost ~50 µs of pure dispatch overhead a
  step (the MLP benchmark's 0.95, against 0.98 wanted). So the checks are plain float
  arithmetic on the host (a sorted window for the median) and a bad step is skipped by
  not calling ``optimizer.step()`` at all. :func:`checks_on_host` chooses.

float32 rule: the device computes the threshold as a float32 product; the host multiplies
the two float32 values in double (exact: 24 + 24 bits fit in 53) and rounds once to
float32, which is the same IEEE result, so both paths flag the same steps.
"""

from __future__ import annotations

import bisect
import math
import struct

import torch

from workbench.guard.flags import all_reduce_flags

__all__ = ["DeviceChecks", "HostChecks", "checks_on_host", "MAX_PENDING"]

# The host reads the accumulated rows at least this often even without a logging point,
# so the per-step records kept on the device stay small (one sync per this many steps).
MAX_PENDING = 1024

# Decide on the host where the device is the CPU. Tests set it False to run the
# accelerator path on CPU (it is the one a GPU run takes).
HOST_DECIDES_ON_CPU = True

Row = tuple[float, float, float, float]  # nonfinite, spike, loss, threshold


def checks_on_host(device: torch.device, plain_optimizer: bool) -> bool:
    """Whether a run on ``device`` judges its steps on the host: a CPU run whose optimizer
    step can simply be left out (no loss scaler or engine that must see every step)."""
    return HOST_DECIDES_ON_CPU and device.type == "cpu" and plain_optimizer


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a float32 tensor would hold)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class DeviceChecks:
    """Checks as device ops, no host sync per step; rows read in one sync at ``read``."""

    def __init__(self, spike_factor: float, window: int, check_nonfinite: bool, check_spike: bool,
                 optimizer: torch.optim.Optimizer, device: torch.device, num_processes: int,
                 found_inf: bool) -> None:
        self.window = window
        self.optimizer = optimizer
        self.num_processes = num_processes
        self._found_inf = found_inf
        self._check_nonfinite = check_nonfinite
        self._check_spike = check_spike
        self._ring = torch.full((window,), float("nan"), dtype=torch.float32, device=device)
        self._slots = self._ring.unbind()  # one view per slot, made once (a view costs an op's overhead)
        # Constants and outputs made once: each step writes into them (out=), no allocation.
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._factor = torch.tensor(spike_factor, dtype=torch.float32, device=device)
        self._bad = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: skip (found_inf's dtype)
        self._bad_mask = torch.zeros((), dtype=torch.bool, device=device)
        self.pos = 0  # next ring slot (host int: indexing with it is no sync)
        self.seen = 0  # steps observed; the spike test starts once a window is full
        self._step_bad: torch.Tensor | None = None  # this step's flag, for after_step's masking
        self._backup: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._known: set[int] = set()
        # One row per step not read yet, preallocated and written in place. A threshold
        # stays NaN when the spike check is off.
        self._rows = torch.zeros((MAX_PENDING, 4), dtype=torch.float32, device=device)
        self._rows[:, 3] = float("nan")
        self._row_views: list[tuple[torch.Tensor, ...]] = []  # per row, made on first use
        self._losses: list[torch.Tensor | None] = [None] * MAX_PENDING

    def check(self, index: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Judge the step whose row is ``index`` on the device and arm the optimizer to skip
        it; returns False: the optimizer step is always taken (a no-op when bad).

        On an overhead-bound run every small op costs ~3 µs of host time, so this is a
        fixed sequence of in-place ops into preallocated tensors (no stack, no allocation
        but nanmedian's result):

        - the loss is kept by reference (no op): ``read`` writes it into the rows;
        - nonfinite: ``w = (g - g) + 0 * loss`` is 0 when the loss and the gradient norm
          ``g`` are finite and NaN otherwise (``inf - inf`` and ``0 * inf`` are NaN), and
          ``w != w`` is the flag: three ops where ``isfinite`` alone is four kernels;
        - spike: ``threshold = nanmedian(ring) * spike_factor``, ``loss > threshold``;
        - across processes, one all-reduce (MAX) of the row's two flags
          (distributed/guard_flags.py says why);
        - ``bad = max(nonfinite, spike)`` as a float 0/1: fused Adam's ``found_inf`` as is;
        - the ring takes the loss unless the step is bad.
        """
        if index == len(self._row_views):
            row = self._rows[index]
            self._row_views.append((row[:2], *row.unbind()))
        flags, nonfinite, spike, _, threshold = self._row_views[index]
        self._losses[index] = loss  # a reference: the row's loss column is filled at read
        if self._check_nonfinite:
            if isinstance(grad_norm, torch.Tensor):
                torch.sub(grad_norm, grad_norm, out=nonfinite)
                nonfinite.add_(loss, alpha=0)
            else:
                torch.sub(loss, loss, out=nonfinite)
            torch.ne(nonfinite, nonfinite, out=nonfinite)
        spike_on = self._check_spike and self.seen >= self.window
        if self._check_spike:
            torch.mul(torch.nanmedian(self._ring), self._factor, out=threshold)
            if spike_on:
                torch.gt(loss, threshold, out=spike)  # False for NaN: a non-finite loss is not a spike
        if self.num_processes > 1 and (self._check_nonfinite or spike_on):
            all_reduce_flags(flags)  # every rank counts the same steps: spike_on is the same on all
        # The float flag fused Adam reads; without a check that can fire, no flag at all.
        if self._check_nonfinite and spike_on:
            bad = torch.maximum(nonfinite, spike, out=self._bad)
        elif self._check_nonfinite:
            bad = nonfinite
        elif spike_on:
            bad = spike
        else:
            bad = None
        if self._check_spike:
            # Only accepted losses enter the running median: a spike must not raise its own bar.
            slot = self._slots[self.pos]
            if bad is None:
                slot.copy_(loss)
            else:
                torch.where(torch.ne(bad, self._zero, out=self._bad_mask), slot, loss, out=slot)
            self.pos = (self.pos + 1) % self.window
        self.seen += 1
        if self._found_inf:
            self.optimizer.found_inf = bad
        else:
            self._step_bad = torch.ne(bad, self._zero, out=self._bad_mask) if bad is not None else None
            if self._step_bad is not None:
                self._backup = [(t, t.detach().clone()) for t in _mutable_tensors(self.optimizer)]
                self._known = {id(t) for t, _ in self._backup}
        return False

    def after_step(self) -> None:
        """Put back the pre-step values where the step was bad (optimizers without found_inf)."""
        if self._found_inf:
            self.optimizer.found_inf = None  # a later plain step() must not see a stale flag
            return
        bad = self._step_bad
        if bad is None:
            return
        for tensor, old in self._backup:
            if tensor.device == bad.device:  # host-side counters cannot be masked without a sync
                tensor.data.copy_(torch.where(bad, old, tensor.data))
        # State the first step created (Adam's moments, SGD's momentum) goes back to zeros,
        # what the optimizer would start from on the next step.
        for tensor in _mutable_tensors(self.optimizer):
            if id(tensor) not in self._known and tensor.device == bad.device:
                tensor.data.copy_(torch.where(bad, torch.zeros_like(tensor), tensor.data))
        self._backup, self._known = [], set()

    def read(self, count: int) -> list[Row]:
        """The rows of the first ``count`` steps (one host sync), then ready for reuse."""
        self._rows[:count, 2] = torch.stack(self._losses[:count])
        rows = self._rows[:count].tolist()
        self._losses[:count] = [None] * count
        if self._check_spike:
            self._rows[:count, 1].zero_()  # the only column a step may leave unwritten
        return [tuple(row) for row in rows]

    def ring(self) -> list[float]:
        return self._ring.tolist()

    def set_ring(self, ring: list[float], pos: int, seen: int) -> None:
        self._ring.copy_(torch.tensor(ring, dtype=torch.float32))
        self.pos, self.seen = pos, seen


class HostChecks:
    """The same checks as float arithmetic on the host; a bad step is left out by the caller."""

    def __init__(self, spike_factor: float, window: int, check_nonfinite: bool, check_spike: bool,
                 num_processes: int) -> None:
        self.window = window
        self.num_processes = num_processes
        self._factor = _f32(spike_factor)
        self._check_nonfinite = check_nonfinite
        self._check_spike = check_spike
        self._ring = [math.nan] * window
        self._sorted: list[float] = []  # the ring's non-NaN values, kept sorted for the median
        self._flags = torch.zeros(2, dtype=torch.float32)  # for the agreement across ranks
        self.pos = 0
        self.seen = 0
        self._rows: list[Row] = []

    def check(self, index: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Judge the step whose row is ``index``; returns True when its optimizer step must be
        left out (every rank returns the same: the flags are agreed first)."""
        value = loss.item()  # a float32 loss: the double holds it exactly
        nonfinite = spike = False
        if self._check_nonfinite:
            nonfinite = not math.isfinite(value) or (
                isinstance(grad_norm, torch.Tensor) and not math.isfinite(grad_norm.item()))
        threshold = math.nan
        spike_on = self._check_spike and self.seen >= self.window
        if self._check_spike:
            if self._sorted:  # torch.nanmedian's rule: the lower of the two middle values
                threshold = _f32(self._sorted[(len(self._sorted) - 1) // 2] * self._factor)
            spike = spike_on and value > threshold
        if self.num_processes > 1 and (self._check_nonfinite or spike_on):
            flags = self._flags
            flags[0], flags[1] = float(nonfinite), float(spike)
            all_reduce_flags(flags)
            nonfinite, spike = bool(flags[0]), bool(flags[1])
        bad = nonfinite or spike  # each is False unless its check is on (spike: once a window is full)
        if self._check_spike:
            if not bad:  # only accepted losses enter the running median
                self._replace(self.pos, value)
            self.pos = (self.pos + 1) % self.window
        self.seen += 1
        row = (float(nonfinite), float(spike), value, threshold)
        if index == len(self._rows):
            self._rows.append(row)
        else:
            self._rows[index] = row
        return bad

    def after_step(self) -> None:
        """Nothing to put back: a bad step's optimizer step was not taken."""

    def read(self, count: int) -> list[Row]:
        return self._rows[:count]

    def ring(self) -> list[float]:
        return list(self._ring)

    def set_ring(self, ring: list[float], pos: int, seen: int) -> None:
        self._ring = [_f32(v) for v in ring]
        self._sorted = sorted(v for v in self._ring if not math.isnan(v))
        self.pos, self.seen = pos, seen

    def _replace(self, slot: int, value: float) -> None:
        old = self._ring[slot]
        if not math.isnan(old):
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        if not math.isnan(value):
            bisect.insort(self._sorted, value)
        self._ring[slot] = value


def _mutable_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters and optimizer-state tensors a step may change."""
    tensors = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensors.append(param)
            tensors.extend(v for v in optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor))
    return tensors
