"""Guarding a run against non-finite and spiking losses (issue #18).

Two parts with one job each:

- :class:`Guard` is the user's choice (the ``[guard]`` config table, ``Trainer(guard=...)``),
  validated once when it is made.
- :class:`GuardMonitor` is what a guarded training loop runs: detection on the device every
  step, the step's update masked on the device when it is bad, and the host reading the
  accumulated flags only at points that already synchronize (logging, saving, the end).

Why the device: reading a flag on the host each step would stall the GPU queue every step
(DESIGN.md section 4: no host sync per step). So a bad step is never *decided* on the host;
its update is made a no-op by the optimizer itself (the fused Adam/AdamW ``found_inf``
path that AMP's loss scaler uses: a 1 makes ``step()`` leave parameters and optimizer
state untouched), or, for other optimizers, by putting the pre-step values back with
``torch.where`` on a device boolean. The host learns about the interventions later, at a
logging or save point, and records them (events.jsonl, the checkpoint).

Per-step cost: the checks are ~10 small in-place device ops into preallocated tensors (see
``before_step``) and the per-step rows stay on the device until a logging point reads them
all at once; on an overhead-bound CPU run (benchmarks/guard_overhead.py, the MLP) that is a
few tens of µs a step, beside the ~20 µs fused AdamW itself spends on ``found_inf``.

Several ranks: the flags of a step are agreed before its optimizer step by an all-reduce,
so every rank skips the same step (distributed/guard_flags.py: stream-ordered on GPUs).
Rollback, pause and stop are then decided at logging points from the agreed rows, which
every rank reads at the same step: no further exchange is needed.

Scheduler rule: a skipped step still advances the learning-rate schedule, the step counter
and the data position. The schedule stays a function of ``global_step`` (what a resume, the
other ranks and a live LR edit all assume), and deciding otherwise would need the flag on
the host at that very step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from workbench.distributed.guard_flags import all_reduce_flags
from workbench.train.args import ArgumentError


__all__ = ["Guard", "GuardMonitor", "NONFINITE_ACTIONS", "SPIKE_ACTIONS", "GUARD_FIELDS"]

DataOrder = Any  # annotations only: workbench.data.order is imported by the loop that sets it
Trainer = Any  # annotations only: Trainer imports this module (directly or not), so it is not imported back

NONFINITE_ACTIONS = ("off", "skip", "rollback", "pause", "stop")
SPIKE_ACTIONS = ("off", "skip", "rollback", "pause")
# The host reads the accumulated flags at least this often even without a logging point,
# so the per-step records kept on the device stay small (one sync per this many steps).
MAX_PENDING = 1024


@dataclass(frozen=True)
class Guard:
    """What to do about a non-finite or spiking loss; everything off by default (HF parity).

    ``nonfinite``: action when the step's loss (or gradient norm) is NaN/inf.
    ``spike``: action when the step's loss exceeds ``spike_factor`` x the running median of
    the last ``window`` accepted steps (checked once ``window`` steps were seen).
    ``snapshot_every`` / ``snapshots``: in-memory snapshots for rollback (steps apart, ring size);
    every checkpoint save is a snapshot too, so a resumed run rolls back as the uninterrupted one.
    ``rollback_skip``: data batches skipped past the spike after a rollback.
    ``lr_backoff``: factor applied to the learning rate after a rollback (None: unchanged).
    ``max_interventions``: after this many, pause an interactive run or stop a headless run
    with a checkpoint (None: no limit).
    """

    nonfinite: str = "off"
    spike: str = "off"
    spike_factor: float = 3.0
    window: int = 50
    snapshot_every: int = 50
    snapshots: int = 1
    rollback_skip: int = 0
    lr_backoff: float | None = None
    max_interventions: int | None = None

    def __post_init__(self) -> None:
        # ArgumentError names the field: the config loader turns it into "file:line: guard.KEY: reason".
        if self.nonfinite not in NONFINITE_ACTIONS:
            raise ArgumentError("nonfinite", f"expected one of {', '.join(NONFINITE_ACTIONS)}, got {self.nonfinite!r}")
        if self.spike not in SPIKE_ACTIONS:
            raise ArgumentError("spike", f"expected one of {', '.join(SPIKE_ACTIONS)}, got {self.spike!r}")
        if isinstance(self.spike_factor, bool) or not isinstance(self.spike_factor, (int, float)) \
                or not math.isfinite(self.spike_factor) or self.spike_factor <= 1:
            raise ArgumentError("spike_factor", f"expected a number > 1, got {self.spike_factor!r}")
        for name, low in (("window", 1), ("snapshot_every", 1), ("snapshots", 1), ("rollback_skip", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(name, f"expected an integer >= {low}, got {value!r}")
        if self.lr_backoff is not None and (isinstance(self.lr_backoff, bool)
                                            or not isinstance(self.lr_backoff, (int, float))
                                            or not 0 < self.lr_backoff <= 1):
            raise ArgumentError("lr_backoff", f"expected a factor in (0, 1], got {self.lr_backoff!r}")
        if self.max_interventions is not None and (isinstance(self.max_interventions, bool)
                                                   or not isinstance(self.max_interventions, int)
                                                   or self.max_interventions < 1):
            raise ArgumentError("max_interventions", f"expected an integer >= 1, got {self.max_interventions!r}")

    @property
    def active(self) -> bool:
        """Whether anything is watched (an inactive guard costs the loop one attribute check)."""
        return self.nonfinite != "off" or self.spike != "off"

    @property
    def rolls_back(self) -> bool:
        """Whether an action is rollback (then the loop keeps a ring of in-memory snapshots)."""
        return "rollback" in (self.nonfinite, self.spike)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Guard":
        """A Guard from a ``[guard]`` table; unknown keys raise ArgumentError naming the key."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ArgumentError(key, f"unknown key (expected one of: {', '.join(names)})")
        return cls(**data)


GUARD_FIELDS = tuple(f.name for f in dataclasses.fields(Guard))


class GuardMonitor:
    """The guard of one training run: device-side detection and masking, host-side records.

    The loop calls ``add_loss`` per micro-batch, ``before_step`` / ``after_step`` around the
    optimizer step and ``end_step`` after the step counter moved; ``collect`` (at logging,
    save and end points, which synchronize anyway) reads what happened and returns the new
    interventions.
    """

    # Set by the loop: recomputes the dataset rows of a bad step (data/order.py), so a record
    # names its samples at no per-step cost; None records positions only.
    order: "DataOrder | None" = None

    def __init__(self, guard: Guard, optimizer: torch.optim.Optimizer, device: torch.device,
                 num_processes: int = 1, saved: dict[str, Any] | None = None, *,
                 allow_found_inf: bool = True) -> None:
        self.guard = guard
        self.device = device
        self.num_processes = num_processes
        # Accelerate's wrapper (loss scaling, engines) holds the torch optimizer as .optimizer.
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        # A loss scaler sets found_inf itself (and would overwrite ours): mask instead there.
        self._found_inf = allow_found_inf and _supports_found_inf(self.optimizer)
        self._check_nonfinite = guard.nonfinite != "off"
        self._check_spike = guard.spike != "off"
        self._ring = torch.full((guard.window,), float("nan"), dtype=torch.float32, device=device)
        self._slots = self._ring.unbind()  # one view per slot, made once (a view costs an op's overhead)
        # Constants and outputs made once: each step writes into them (out=), no allocation.
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._factor = torch.tensor(guard.spike_factor, dtype=torch.float32, device=device)
        self._bad = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: skip (found_inf's dtype)
        self._bad_mask = torch.zeros((), dtype=torch.bool, device=device)
        self._pos = 0  # next ring slot (host int: indexing with it is no sync)
        self._seen = 0  # steps observed; the spike test starts once a window is full
        self._loss: torch.Tensor | None = None
        self._step_bad: torch.Tensor = self._zero  # this step's flag, for after_step's masking
        self._backup: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._known: set[int] = set()
        # One row per step not read yet, preallocated on the device and written in place:
        # (nonfinite, spike, loss, threshold); beside it on the host, where the step's data
        # came from: (step, epoch, first batch, last batch). A threshold stays NaN when the
        # spike check is off.
        self._rows = torch.zeros((MAX_PENDING, 4), dtype=torch.float32, device=device)
        self._rows[:, 3] = float("nan")
        self._row_views: list[tuple[torch.Tensor, ...]] = []  # per row, made on first use
        self._where: list[tuple[int, int, int, int] | None] = [None] * MAX_PENDING
        self._losses: list[torch.Tensor | None] = [None] * MAX_PENDING
        self._count = 0  # rows written since the last collect
        self.interventions: list[dict[str, Any]] = []
        self.new: list[dict[str, Any]] = []  # found by the last collect
        # Data the run jumped over (rollbacks), so the data position is no longer a function
        # of the step: micro-batches skipped in all, and where the next step starts
        # ([epoch, micro-batch], set by the loop each step). Both go into checkpoints.
        self.skipped = 0
        self.position: tuple[int, int] | None = None
        if saved:
            self.restore(saved)

    # -- per step (device only) ---------------------------------------------------------

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's (scaled) loss; their sum is the step's loss."""
        loss = loss.float()  # no-op for float32 losses; half-precision ones are summed in float32
        self._loss = loss if self._loss is None else self._loss + loss

    def before_step(self, grad_norm: torch.Tensor | None) -> None:
        """Decide on the device whether this step is bad and arm the optimizer to skip it.

        On an overhead-bound run every small op costs ~3 µs of host time, so this is a
        fixed sequence of in-place ops into preallocated tensors (no stack, no allocation
        but nanmedian's result):

        - the loss is kept by reference (no op): ``collect`` writes it into the rows;
        - nonfinite: ``w = (g - g) + 0 * loss`` is 0 when the loss and the gradient norm
          ``g`` are finite and NaN otherwise (``inf - inf`` and ``0 * inf`` are NaN), and
          ``w != w`` is the flag: three ops where ``isfinite`` alone is four kernels;
        - spike: ``threshold = nanmedian(ring) * spike_factor``, ``loss > threshold``;
        - across processes, one all-reduce (MAX) of the row's two flags
          (distributed/guard_flags.py says why);
        - ``bad = max(nonfinite, spike)`` as a float 0/1: fused Adam's ``found_inf`` as is;
        - the ring takes the loss unless the step is bad.
        """
        count = self._count
        if count == len(self._row_views):
            row = self._rows[count]
            self._row_views.append((row[:2], *row.unbind()))
        flags, nonfinite, spike, _, threshold = self._row_views[count]
        loss, self._loss = self._loss, None
        self._losses[count] = loss  # a reference: the row's loss column is filled at collect
        if self._check_nonfinite:
            if isinstance(grad_norm, torch.Tensor):
                torch.sub(grad_norm, grad_norm, out=nonfinite)
                nonfinite.add_(loss, alpha=0)
            else:
                torch.sub(loss, loss, out=nonfinite)
            torch.ne(nonfinite, nonfinite, out=nonfinite)
        spike_on = self._check_spike and self._seen >= self.guard.window
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
            slot = self._slots[self._pos]
            if bad is None:
                slot.copy_(loss)
            else:
                torch.where(torch.ne(bad, self._zero, out=self._bad_mask), slot, loss, out=slot)
            self._pos = (self._pos + 1) % self.guard.window
        self._seen += 1
        if self._found_inf:
            self.optimizer.found_inf = bad
        else:
            self._step_bad = torch.ne(bad, self._zero, out=self._bad_mask) if bad is not None else None
            if self._step_bad is not None:
                self._backup = [(t, t.detach().clone()) for t in self._mutable_tensors()]
                self._known = {id(t) for t, _ in self._backup}

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
        for tensor in self._mutable_tensors():
            if id(tensor) not in self._known and tensor.device == bad.device:
                tensor.data.copy_(torch.where(bad, torch.zeros_like(tensor), tensor.data))
        self._backup, self._known = [], set()

    def end_step(self, step: int, epoch: int, first_batch: int, last_batch: int) -> None:
        """Remember where this step's data came from, beside its row on the device."""
        self._where[self._count] = (step, epoch, first_batch, last_batch)
        self._count += 1

    def due(self) -> bool:
        """Whether the records kept on the device should be read now (bounded memory)."""
        return self._count >= MAX_PENDING

    # -- at synchronizing points (host) ---------------------------------------------------

    def collect(self, rank: int = 0) -> list[dict[str, Any]]:
        """Read the flags of the steps since the last call (one host sync) and return the
        interventions among them, also appended to ``self.interventions``."""
        count = self._count
        if not count:
            return []
        self._rows[:count, 2] = torch.stack(self._losses[:count])
        rows = self._rows[:count].tolist()  # host sync: a logging/save point
        found = []
        for (where, (nonfinite, spike, loss, threshold)) in zip(self._where[:count], rows):
            if not (nonfinite or spike):
                continue
            step, epoch, first, last = where
            kind = "nonfinite" if nonfinite else "spike"
            action = self.guard.nonfinite if nonfinite else self.guard.spike
            record = {"step": step, "rank": rank, "kind": kind, "value": _json_number(loss),
                      "threshold": _json_number(threshold), "action": action,
                      "epoch": epoch, "batches": [first, last]}
            record.update(self.sample_ids(epoch, first, last))
            found.append(record)
        self._count = 0
        self._losses[:count] = [None] * count
        if self._check_spike:
            self._rows[:count, 1].zero_()  # the only column a step may leave unwritten
        self.interventions.extend(found)
        return found

    def sample_ids(self, epoch: int, first: int, last: int) -> dict[str, Any]:
        """Record fields naming the dataset rows of micro-batches ``first..last`` of ``epoch``:
        ``samples``, every rank's rows (rank 0's first), and with several ranks
        ``samples_by_rank`` too; nothing when the data order is not known."""
        per_rank = self.order.samples(epoch, first, last) if self.order is not None else None
        if per_rank is None:
            return {}
        fields: dict[str, Any] = {"samples": [i for ids in per_rank for i in ids]}
        if len(per_rank) > 1:
            fields["samples_by_rank"] = per_rank
        return fields

    def limit_reached(self) -> bool:
        limit = self.guard.max_interventions
        return limit is not None and len(self.interventions) >= limit

    def export(self) -> dict[str, Any]:
        """What a checkpoint keeps (workbench_state.json): interventions and the detector's
        state, so a resumed run decides exactly as the uninterrupted one. Call ``collect`` first."""
        data = {"skipped": self.skipped, "position": list(self.position) if self.position else None}
        return {"interventions": [dict(r) for r in self.interventions], **self.detector(), "data": data}

    def detector(self) -> dict[str, Any]:
        """The spike detector's state (a host read of the running-median ring)."""
        return {"ring": self._ring.tolist(), "pos": self._pos, "seen": self._seen}

    def restore(self, saved: dict[str, Any]) -> None:
        """Back to an exported state: interventions, data offset and detector."""
        self.interventions = [dict(r) for r in saved.get("interventions", [])]
        data = saved.get("data") or {}
        self.skipped = int(data.get("skipped", 0))
        self.position = tuple(data["position"]) if data.get("position") else None
        self.restore_detector(saved)

    def restore_detector(self, saved: dict[str, Any]) -> None:
        """Put the running-median ring back (a snapshot's or a checkpoint's)."""
        ring = saved.get("ring")
        if ring is not None and len(ring) == self.guard.window:
            self._ring.copy_(torch.tensor(ring, dtype=torch.float32))
            self._pos = int(saved.get("pos", 0)) % self.guard.window
            self._seen = int(saved.get("seen", 0))

    # -- helpers --------------------------------------------------------------------------

    def _mutable_tensors(self) -> list[torch.Tensor]:
        """Parameters and optimizer-state tensors a step may change."""
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                tensors.append(param)
                tensors.extend(v for v in self.optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor))
        return tensors


def _supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused Adam/AdamW skip a step when ``found_inf`` is 1 (params and state kept)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    return bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)


def _json_number(value: float) -> float | str:
    """events.jsonl is strict JSON: NaN/inf are written as strings."""
    return value if math.isfinite(value) else str(value)


def guard_for(trainer: "Trainer") -> Guard | None:
    """The trainer's guard when it watches anything, else None (the loop's one check)."""
    guard = getattr(trainer, "guard", None)
    return guard if guard is not None and guard.active else None
