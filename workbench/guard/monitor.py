"""The guard's records of one run: the per-step checks (checks.py: on the device, or on the
host for CPU runs) and what the host reads back at points that synchronize anyway (a log,
a save, the end): the interventions, the detector's state, whether the guard is getting
anywhere (``max_no_progress``), and how many of its records events.jsonl takes a minute.

Where a step is judged: on an accelerator, on the device. Reading a flag on the host each
step would stall the GPU queue every step (no host sync per step), so there a bad step is
never *decided* on the host; its update is made a no-op by the optimizer itself (the fused
Adam/AdamW ``found_inf`` path that AMP's loss scaler uses: a 1 makes ``step()`` leave
parameters and optimizer state untouched), or, for other optimizers, by putting the
pre-step values back with ``torch.where`` on a device boolean, and the host learns about it
at the next read point. On the CPU the host *is* the device: reading the loss waits for
nothing, so the checks are float arithmetic and a bad step's optimizer step is simply left
out (the same decisions, rows and detector state; on the MLP benchmark no measurable cost,
against ~200 µs a step for the device ops: benchmarks/guard_overhead.py).

Several ranks: the flags of a step are agreed before its optimizer step by an all-reduce
(flags.py: stream-ordered on GPUs), so every rank skips the same step. Rollback, pause and
stop are then decided at read points from the agreed rows, which every rank reads at the
same step: no further exchange is needed.

Scheduler rule: a skipped step still advances the learning-rate schedule, the step counter
and the data position. The schedule stays a function of ``global_step`` (what a resume, the
other ranks and a live LR edit all assume), and deciding otherwise would need the flag on
the host at that very step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workbench.guard.checks import MAX_PENDING, DeviceChecks, HostChecks, checks_on_host
from workbench.guard.samples import DataOrder
from workbench.guard.settings import Guard

__all__ = ["GuardMonitor", "EventBudget"]


class GuardMonitor:
    """The guard of one training run: per-step checks (guard_checks.py: on the device, or on
    the host for CPU runs), host-side records.

    The loop calls ``add_loss`` per micro-batch, ``before_step`` / ``after_step`` around the
    optimizer step (leaving the step out when ``before_step`` says so) and ``end_step``
    after the step counter moved; ``collect`` (at logging, save and end points, which
    synchronize anyway) reads what happened and returns the new interventions.
    """

    # Set by the guard's runner: recomputes the dataset rows of a bad step (samples.py), so a
    # record names its samples at no per-step cost; None records positions only.
    order: DataOrder | None = None

    def __init__(self, guard: Guard, optimizer: torch.optim.Optimizer, device: torch.device,
                 num_processes: int = 1, saved: dict[str, Any] | None = None, *,
                 allow_found_inf: bool = True) -> None:
        self.guard = guard
        # Accelerate's wrapper (loss scaling, engines) holds the torch optimizer as .optimizer.
        inner = self._inner = getattr(optimizer, "optimizer", optimizer)
        checks = (guard.spike_factor, guard.window, guard.nonfinite != "off", guard.spike != "off")
        # allow_found_inf: no loss scaler or engine, so a step can be flagged or left out.
        self.checks: DeviceChecks | HostChecks
        if checks_on_host(torch.device(device), allow_found_inf):
            self.checks = HostChecks(*checks, num_processes)
        else:
            # A loss scaler sets found_inf itself (and would overwrite ours): mask instead there.
            found_inf = allow_found_inf and _supports_found_inf(inner)
            self.checks = DeviceChecks(*checks, inner, device, num_processes, found_inf)
        self._loss: torch.Tensor | None = None
        # Where each step not read yet took its data from: (step, epoch, first batch, last batch).
        self._where: list[tuple[int, int, int, int] | None] = [None] * MAX_PENDING
        self._count = 0  # steps since the last collect
        self.interventions: list[dict[str, Any]] = []
        self.new: list[dict[str, Any]] = []  # found by the last collect
        # No progress (Guard.max_no_progress): interventions since the last accepted step, and
        # rollbacks per restored step, since the last escalation; why the last one escalated.
        self.in_a_row = 0
        self.restores: dict[int, int] = {}
        self.escalated: str | None = None
        self.events = EventBudget()
        if saved:
            self.restore(saved)

    # -- per step -------------------------------------------------------------------------

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's (scaled) loss; their sum is the step's loss."""
        loss = loss.float()  # no-op for float32 losses; half-precision ones are summed in float32
        self._loss = loss if self._loss is None else self._loss + loss

    def before_step(self, grad_norm: torch.Tensor | None) -> bool:
        """Judge this step before its optimizer step; True when the caller must leave the
        optimizer step out (host checks), False when it is taken and, if bad, made a no-op
        on the device."""
        loss, self._loss = self._loss, None
        leave_out = self.checks.check(self._count, loss, grad_norm)
        if leave_out:
            # A left-out step counts as taken (as a no-op) for torch's LR schedulers, which
            # otherwise warn that their first step came before the optimizer's.
            self._inner._opt_called = True
        return leave_out

    def after_step(self) -> None:
        """Undo a bad step's update where the device could not skip it (see DeviceChecks)."""
        self.checks.after_step()

    def end_step(self, step: int, epoch: int, first_batch: int, last_batch: int) -> None:
        """Remember where this step's data came from, beside its row."""
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
        found = []
        for (where, (nonfinite, spike, loss, threshold)) in zip(self._where[:count], self.checks.read(count)):
            step, epoch, first, last = where
            if not (nonfinite or spike):
                self.in_a_row = 0  # an accepted step: the guard is getting somewhere
                continue
            self.in_a_row += 1
            kind = "nonfinite" if nonfinite else "spike"
            action = self.guard.nonfinite if nonfinite else self.guard.spike
            record = {"step": step, "rank": rank, "kind": kind, "value": _json_number(loss),
                      "threshold": _json_number(threshold), "action": action,
                      "epoch": epoch, "batches": [first, last]}
            record.update(self.sample_ids(epoch, first, last))
            found.append(record)
        self._count = 0
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

    def rolled_back_to(self, step: int) -> None:
        """A rollback restored ``step`` (counted for max_no_progress)."""
        self.restores[step] = self.restores.get(step, 0) + 1

    def no_progress(self) -> str | None:
        """Why the guard is getting nowhere (Guard.max_no_progress), in a few words, or None.
        Saying so starts the count again: after an escalation (a pause the user resumes) the
        run gets as many tries again."""
        limit = self.guard.max_no_progress
        if limit is None:
            return None
        why = None
        step = next((s for s, n in self.restores.items() if n >= limit), None)
        if step is not None:
            why = f"{self.restores[step]} rollbacks to step {step} without getting past it"
        elif self.in_a_row >= limit:
            recent = self.interventions[-self.in_a_row:]
            kinds = " and ".join(sorted({r["kind"] for r in recent}))
            first, last = min(r["step"] for r in recent), max(r["step"] for r in recent)
            where = f"steps {first}-{last}" if first != last else f"step {first}"
            why = f"{self.in_a_row} interventions in a row without an accepted step ({kinds}, {where})"
        if why is not None:
            self.in_a_row, self.restores, self.escalated = 0, {}, why
        return why

    def export(self) -> dict[str, Any]:
        """What a checkpoint keeps (workbench_state.json): interventions and the detector's
        state, so a resumed run decides exactly as the uninterrupted one. Call ``collect`` first."""
        progress = {"in_a_row": self.in_a_row, "restores": {str(k): v for k, v in self.restores.items()},
                    "escalated": self.escalated}
        return {"interventions": [dict(r) for r in self.interventions], **self.detector(), "progress": progress}

    def detector(self) -> dict[str, Any]:
        """The spike detector's state (a host read of the running-median ring)."""
        checks = self.checks
        return {"ring": checks.ring(), "pos": checks.pos, "seen": checks.seen}

    def restore(self, saved: dict[str, Any]) -> None:
        """Back to an exported state: interventions, progress and detector."""
        self.interventions = [dict(r) for r in saved.get("interventions", [])]
        progress = saved.get("progress") or {}
        self.in_a_row = int(progress.get("in_a_row", 0))
        self.restores = {int(k): int(v) for k, v in (progress.get("restores") or {}).items()}
        self.escalated = progress.get("escalated")
        self.restore_detector(saved)

    def restore_detector(self, saved: dict[str, Any]) -> None:
        """Put the running-median ring back (a snapshot's or a checkpoint's)."""
        ring = saved.get("ring")
        if ring is not None and len(ring) == self.guard.window:
            self.checks.set_ring(ring, int(saved.get("pos", 0)) % self.guard.window, int(saved.get("seen", 0)))


class EventBudget:
    """At most ``per_minute`` guard events a minute in events.jsonl: a run whose every step is
    bad would otherwise write a line a step. Past the budget the records are counted, and one
    ``guard_summary`` record says how many of which kind were left out (every intervention
    stays in workbench_state.json and the checkpoints)."""

    def __init__(self, per_minute: int = 60) -> None:
        self.per_minute = per_minute
        self._start: float | None = None
        self._written = 0
        self._left_out: dict[str, int] = {}
        self._steps: list[int] = []

    def admit(self, record: dict[str, Any], now: float) -> tuple[bool, dict[str, Any] | None]:
        """(whether ``record`` is written, the summary of an ended minute that left records out,
        to write before it)."""
        summary = None
        if self._start is None or now - self._start >= 60:
            summary = self.summary() if self._start is not None else None
            self._start, self._written = now, 0
        if self._written < self.per_minute:
            self._written += 1
            return True, summary
        self._left_out[record["kind"]] = self._left_out.get(record["kind"], 0) + 1
        self._steps = [self._steps[0] if self._steps else record["step"], record["step"]]
        return False, summary

    def summary(self) -> dict[str, Any] | None:
        """The ``guard_summary`` fields for the records left out so far (None: none were), and
        forget them."""
        if not self._left_out:
            return None
        out = {"left_out": dict(self._left_out), "count": sum(self._left_out.values()),
               "steps": list(self._steps), "per_minute": self.per_minute}
        self._left_out, self._steps = {}, []
        return out


def _supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused Adam/AdamW skip a step when ``found_inf`` is 1 (params and state kept)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    return bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)


def _json_number(value: float) -> float | str:
    """events.jsonl is strict JSON: NaN/inf are written as strings."""
    return value if math.isfinite(value) else str(value)
