"""The guard's rollback (issue #18): put the run back at the newest snapshot before a bad
step and move the data past it, so the offending samples are never replayed.

Decided on the host at a guard read point (train/loop.py ``_guard_point``), which the loop
also places at every snapshot boundary: a snapshot is never taken with an unread bad step
before it, so the ring's newest snapshot older than the bad step is always the one to use.
With no such snapshot (an empty ring: a run resumed between snapshots, or a bad step
before the first one) the newest complete checkpoint on disk older than the bad step is
loaded instead. Every rank decides the same (the flags were reduced over ranks before
being recorded) at the same boundary, and each restores its own snapshot.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.checkpoint.snapshots import SnapshotRing
    from workbench.train.guard import GuardMonitor

log = logging.getLogger("workbench")

__all__ = ["roll_back", "advance", "MAX_LISTED_SAMPLES"]

# A rollback's skipped rows are listed up to this many (events.jsonl lines stay readable);
# past it the record keeps the batch range and the count.
MAX_LISTED_SAMPLES = 4096

Trainer = Any  # annotations only: Trainer imports this module (directly or not), so it is not imported back


def advance(position: tuple[int, int], count: int, batches_per_epoch: int | None) -> tuple[int, int]:
    """``position`` ((epoch, micro-batch)) moved forward by ``count`` micro-batches, into the
    next epochs when it runs past one (an epoch of unknown length never ends here)."""
    epoch, batch = position[0], position[1] + count
    if batches_per_epoch:
        epoch, batch = epoch + batch // batches_per_epoch, batch % batches_per_epoch
    return epoch, batch


def _index(position: tuple[int, int], batches_per_epoch: int | None) -> int:
    return position[0] * (batches_per_epoch or 0) + position[1]


def roll_back(trainer: "Trainer", monitor: "GuardMonitor", ring: "SnapshotRing | None", record: dict[str, Any],
              batches_per_epoch: int | None) -> tuple[int, int] | None:
    """Roll back for the bad step of ``record`` (an intervention whose action is rollback).

    Restores model, optimizer, schedule, RNG, step counters and detector; adds to ``record``
    the restored step and the skipped micro-batches; applies ``lr_backoff`` as a recorded
    live edit. Returns where the data resumes ((epoch, micro-batch)), or None when there was
    nothing to roll back to (the bad step stays skipped, as with ``skip``).
    """
    bad_step = record["step"]
    snapshot = ring.before(bad_step) if ring is not None else None
    if snapshot is not None:
        snapshot.restore(trainer)
        monitor.restore_detector(snapshot.detector)
        start = snapshot.position
        source = "memory"
    else:
        restored = _from_disk(trainer, monitor, bad_step, batches_per_epoch)
        if restored is None:
            log.warning("guard: step %d asks for a rollback but there is no snapshot or checkpoint before it; "
                        "the step stays skipped", bad_step)
            record.update(restored_step=None)
            return None
        start, source = restored, "checkpoint"
    guard = monitor.guard
    # Past the bad step's last micro-batch, then rollback_skip more.
    resume = advance((record["epoch"], record["batches"][1] + 1), guard.rollback_skip, batches_per_epoch)
    skipped = _index(resume, batches_per_epoch) - _index(start, batches_per_epoch)
    monitor.skipped += skipped
    monitor.position = resume
    step = trainer.state.global_step
    record.update(restored_step=step, source=source, skipped_from=list(start),
                  skipped_to=list(advance(start, skipped - 1, batches_per_epoch)) if skipped > 0 else None,
                  skipped_batches=skipped)
    record.update(_skipped_samples(monitor, start, skipped))
    if guard.lr_backoff is not None and guard.lr_backoff != 1:
        from workbench.train.edits import apply_edit

        value = apply_edit(trainer, "lr_scale", guard.lr_backoff)
        # A live edit like any other: in events and workbench_state.json; the scaled base
        # rates themselves come back with scheduler.pt on resume.
        trainer.workbench_state.live_edits.append({"step": step, "time": time.time(), "lr_scale": value})
        record["lr_scale"] = value
    return resume


def _skipped_samples(monitor: "GuardMonitor", start: tuple[int, int], count: int) -> dict[str, Any]:
    """The dataset rows of the ``count`` micro-batches the rollback jumped over (every rank's):
    ``skipped_sample_count``, and ``skipped_samples`` unless there are more than
    MAX_LISTED_SAMPLES (then the batch range and the count stand for them)."""
    per_rank = monitor.order.span(start, count) if monitor.order is not None and count > 0 else None
    if per_rank is None:
        return {}
    ids = [i for rank_ids in per_rank for i in rank_ids]
    return {"skipped_samples": ids if len(ids) <= MAX_LISTED_SAMPLES else None, "skipped_sample_count": len(ids)}


def _from_disk(trainer: "Trainer", monitor: "GuardMonitor", bad_step: int,
               batches_per_epoch: int | None) -> tuple[int, int] | None:
    """Load the newest complete checkpoint older than ``bad_step``; its data position, or None.

    The run's history (log, live edits, interventions) is kept: only what the checkpoint
    holds of the training state comes back.
    """
    from workbench.checkpoint.store import CheckpointStore
    from workbench.checkpoint.trainer_state import load_training_state

    trainer.checkpoint_writer.wait()  # a background save still being written may be the one
    store = CheckpointStore(trainer._get_output_dir(trial=None))
    # The newest one older than the bad step that verifies: a damaged file is never loaded.
    rows = [row for row in store.list() if row.complete and row.step < bad_step]
    path = next((Path(row.path) for row in reversed(rows) if store.problem(row.path) is None), None)
    if path is None:
        return None
    state, extras = trainer.state, trainer.workbench_state
    load_training_state(trainer, path)
    loaded, loaded_extras = trainer.state, trainer.workbench_state
    trainer.state, trainer.workbench_state = state, extras  # the run's history stays
    state.global_step, state.epoch = loaded.global_step, loaded.epoch
    saved = loaded_extras.guard or {}
    monitor.restore_detector(saved)
    monitor.skipped = int((saved.get("data") or {}).get("skipped", 0))  # what that checkpoint had skipped
    position = (saved.get("data") or {}).get("position")
    if position:
        return int(position[0]), int(position[1])
    # Saved before any rollback: the position is the step's (the loop's resume rule).
    ga = trainer.args.gradient_accumulation_steps
    per_epoch = getattr(trainer, "_updates_per_epoch", None)
    if not per_epoch:
        return 0, loaded.global_step * ga
    return loaded.global_step // per_epoch, (loaded.global_step % per_epoch) * ga
