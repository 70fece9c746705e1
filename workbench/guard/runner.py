"""The guard a training loop holds: :func:`make_guard` gives an :class:`ActiveGuard` when
something is watched and :class:`NoGuard` otherwise, whose every method does nothing, so
the loop calls the guard at its points without asking whether there is one.

The points, in a step's order: ``add_loss`` (each micro-batch), ``before_step`` (may leave
the optimizer step out), ``after_step``, ``end_step`` (where the step's data came from),
then ``read_point`` at the step end, after the callbacks and gates have said whether the
step logs, saves, evaluates or stops: at such points, which synchronize anyway, and when
enough steps are pending, the guard reads its flags, records the interventions (``guard``
events, ``workbench_state.guard``), carries out a rollback (returning where the data goes
on), escalates (pause through the gates, or stop with a checkpoint) and keeps its rollback
points. ``prepare_save`` brings the records up to date for a checkpoint of the boundary.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from workbench.core.event_file import EventFile
from workbench.core.run import Run
from workbench.guard.monitor import GuardMonitor
from workbench.guard.ring import RollbackPoint, RollbackRing
from workbench.guard.rollback import roll_back
from workbench.guard.samples import DataOrder
from workbench.guard.settings import Guard

log = logging.getLogger("workbench")

__all__ = ["make_guard", "ActiveGuard", "NoGuard"]


class NoGuard:
    """The guard of a run that watches nothing: one method call a point, nothing done."""

    active = False

    def add_loss(self, loss: torch.Tensor) -> None:
        pass

    def before_step(self, grad_norm: torch.Tensor | None) -> bool:
        return False

    def after_step(self) -> None:
        pass

    def end_step(self, run: Run, epoch: int, first: int, last: int) -> None:
        pass

    def start(self, run: Run) -> None:
        pass

    def read_point(self, run: Run) -> tuple[int, int] | None:
        return None

    def prepare_save(self, run: Run) -> None:
        pass

    def finish(self, run: Run) -> None:
        pass


class ActiveGuard:
    """The guard of a run that watches something (``Guard.active``)."""

    active = True

    def __init__(self, settings: Guard, run: Run, loader: Any, batches_per_epoch: int | None,
                 allow_found_inf: bool) -> None:
        from workbench.checkpoint.state_dicts import is_fsdp

        acc = run.accelerator
        self.monitor = GuardMonitor(settings, run.optimizer, acc.device, acc.num_processes,
                                    allow_found_inf=allow_found_inf)
        # The rows of a bad step are recomputed when one is recorded, never per step.
        self.monitor.order = DataOrder(loader, batches_per_epoch)
        self.batches_per_epoch = batches_per_epoch
        self.ring: RollbackRing | None = None  # rollback's in-memory points (an action is rollback)
        if settings.rolls_back:
            if is_fsdp(run):
                raise ValueError("guard: rollback keeps full host copies per process and does not support FSDP; "
                                 "use skip, pause or stop")
            self.ring = RollbackRing(settings.snapshot_every, settings.snapshots)
        self._rollback_due: list[dict[str, Any]] = []  # rollbacks read outside a read point (a save)

    # -- each step (delegated to the checks, on the device or the host) ----------------------

    def add_loss(self, loss: torch.Tensor) -> None:
        self.monitor.add_loss(loss)

    def before_step(self, grad_norm: torch.Tensor | None) -> bool:
        return self.monitor.before_step(grad_norm)

    def after_step(self) -> None:
        self.monitor.after_step()

    def end_step(self, run: Run, epoch: int, first: int, last: int) -> None:
        self.monitor.end_step(run.state.global_step, epoch, first, last)

    # -- the run's points -------------------------------------------------------------------------

    def start(self, run: Run) -> None:
        """A run starts: a resumed one decides as the uninterrupted one did (its records and
        detector come from the checkpoint), and the first rollback point is taken if due."""
        if run.workbench_state.guard:
            self.monitor.restore(run.workbench_state.guard)
        if self.ring is not None and self.ring.due(run.state.global_step):
            self._keep_point(run)

    def read_point(self, run: Run) -> tuple[int, int] | None:
        """After a step or epoch end: at points that synchronize anyway (a log, save or
        evaluation is due, the run stops or ends, a rollback point is due) or when enough
        steps are pending, read the flags, record the interventions, and roll back, pause or
        stop if they ask for it. Returns where the data goes on after a rollback (the run is
        at the restored boundary then: the caller drops its unlogged losses), else None."""
        control, state, monitor = run.control, run.state, self.monitor
        # A rollback point's boundary is a read point too (taking it syncs anyway): no point is
        # taken with an unread bad step before it, so rollback always finds the one to use.
        point_due = self.ring is not None and self.ring.due(state.global_step)
        # An evaluation is a read point too: a new best metric can ask for a save after it.
        if not (control.should_log or control.should_save or control.should_evaluate
                or control.should_training_stop or monitor.due()
                or state.global_step >= state.max_steps or point_due or self._rollback_due):
            return None
        restart = self._collect(run, act=True)
        self._escalate(run)  # after a rollback's flags were dropped: a stop it asks for stands
        if restart is None and self.ring is not None and self.ring.due(state.global_step):
            self._keep_point(run)
        return restart

    def prepare_save(self, run: Run) -> None:
        """A checkpoint of this boundary is being written: the interventions up to it go into
        it, and the boundary is kept as a rollback point too, with exactly the state the
        checkpoint captures. A run resumed from that checkpoint has an empty ring and rolls
        back to the checkpoint itself; the uninterrupted run must roll back to the same
        boundary, or the resume is not bitwise equal to it (save_steps and snapshot_every
        need not line up)."""
        self._collect(run, act=False)
        if self.ring is None or self._rollback_due:  # a rollback still to come undoes this state
            return
        if self.ring.due(run.state.global_step, saving=True):
            self._keep_point(run)

    def finish(self, run: Run) -> None:
        """The run ends: the records left out of events.jsonl in the last minute, counted."""
        summary = self.monitor.events.summary()
        if summary is not None and run.accelerator.is_main_process:
            EventFile(run.args.output_dir).write("guard_summary", run.state.global_step, **summary)

    # -- inside ----------------------------------------------------------------------------------

    def _collect(self, run: Run, act: bool) -> tuple[int, int] | None:
        """Read the pending flags (a host sync) and record new interventions: ``guard`` events
        (main process, at most EventBudget's a minute) and ``workbench_state.guard``.

        ``act``: at a read point, where a rollback can be carried out; elsewhere (a save's own
        read) a rollback found is left for the next read point."""
        monitor, acc = self.monitor, run.accelerator
        monitor.new = monitor.collect(acc.process_index)
        self._rollback_due.extend(r for r in monitor.new if r["action"] == "rollback")
        restart = None
        if act and self._rollback_due:
            at_end = run.state.global_step >= run.state.max_steps
            # The earliest bad step: later ones are undone with it.
            restart = roll_back(run, monitor, self.ring, self._rollback_due[0], self.batches_per_epoch)
            self._rollback_due = []
            if restart is not None:
                monitor.rolled_back_to(run.state.global_step)
                # The log, save, evaluate and stop flags set for the undone steps are dropped
                # (the end of the run moved back too).
                control = run.control
                control.should_log = control.should_save = control.should_evaluate = False
                control.should_epoch_stop = False
                if at_end:
                    control.should_training_stop = False
        if monitor.new and acc.is_main_process:
            events = EventFile(run.args.output_dir)
            now = time.time()
            for record in monitor.new:
                write, summary = monitor.events.admit(record, now)
                if summary is not None:
                    events.write("guard_summary", record["step"], **summary)
                if write:
                    events.write("guard", record["step"], **{k: v for k, v in record.items() if k != "step"})
        run.workbench_state.guard = monitor.export()
        return restart

    def _escalate(self, run: Run) -> None:
        """Pause or stop where the new interventions ask for it: their pause or stop action,
        max_interventions reached (once, when an intervention reaches it), or a guard getting
        nowhere (max_no_progress, said in a warning and a ``guard_escalated`` record). An
        interactive run pauses before its next step (a gate holds it); one no one can
        resume stops here with a checkpoint of this boundary, whose weights the guard kept
        clean. The stop says who asked, and every rank decides it alike from the agreed flags."""
        monitor, control, state = self.monitor, run.control, run.state
        new = monitor.new
        stuck = monitor.no_progress() if new else None
        pause = any(r["action"] == "pause" for r in new) or (bool(new) and monitor.limit_reached()) or stuck is not None
        stop = any(r["action"] == "stop" for r in new)
        if not (pause or stop):
            return
        paused = pause and not stop and run.gates.pause_for_guard(run)
        if stuck is not None:
            run.workbench_state.guard = monitor.export()  # the checkpoint says why
            log.warning("guard: no progress: %s; %s", stuck, "pausing" if paused else "stopping with a checkpoint")
            if run.accelerator.is_main_process:
                EventFile(run.args.output_dir).write("guard_escalated", state.global_step, reason=stuck)
        if not paused:
            control.should_save = True
            control.should_training_stop = True
            if not run.stop_decision.is_set():
                run.stop_decision.set("guard", save=True)

    def _keep_point(self, run: Run) -> None:
        """A host copy of this boundary into the rollback ring (blocks for the copy only)."""
        self.ring.add(RollbackPoint.take(run, self.monitor.detector()))


def make_guard(settings: Guard | None, run: Run, loader: Any, batches_per_epoch: int | None,
               allow_found_inf: bool) -> ActiveGuard | NoGuard:
    """The guard of one ``train()`` call: active when ``settings`` watch anything."""
    if settings is None or not settings.active:
        return NoGuard()
    return ActiveGuard(settings, run, loader, batches_per_epoch, allow_found_inf)
