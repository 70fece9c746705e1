"""The guard's rollback (issue #18): put the run back at the newest rollback point before a
bad step and move the data past it, so the offending samples are never replayed.

Decided on the host at a guard read point (``ActiveGuard.read_point``), which also comes at
every rollback-point boundary: a point is never taken with an unread bad step before it, so
the ring's newest point older than the bad step is always the one to use. With no such
point (an empty ring: a run resumed between points, or a bad step before the first one) the
newest verified checkpoint on disk older than the bad step is loaded instead. Every rank
decides the same (the flags were reduced over ranks before being recorded) at the same
boundary, and each restores its own point.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.core.edits import apply_edit

from workbench.core.run import LoopPosition, Run

if TYPE_CHECKING:
    from workbench.guard.monitor import GuardMonitor
    from workbench.guard.ring import RollbackRing

log = logging.getLogger("workbench")

__all__ = ["roll_back", "advance", "resume_position", "MAX_LISTED_SAMPLES"]

# A rollback's skipped rows are listed up to this many (events.jsonl lines stay readable);
# past it the record keeps the batch range and the count.
MAX_LISTED_SAMPLES = 4096



def advance(position: tuple[int, int], count: int, batches_per_epoch: int | None) -> tuple[int, int]:
    """``position`` ((epoch, micro-batch)) moved forward by ``count`` micro-batches, into the
    next epochs when it runs past one (an epoch of unknown length never ends here)."""
    epoch, batch = position[0], position[1] + count
    if batches_per_epoch:
        epoch, batch = epoch + batch // batches_per_epoch, batch % batches_per_epoch
    return epoch, batch


def _index(position: tuple[int, int], batches_per_epoch: int | None) -> int:
    return position[0] * (batches_per_epoch or 0) + position[1]


def roll_back(run: Run, monitor: "GuardMonitor", ring: "RollbackRing | None", record: dict[str, Any],
              batches_per_epoch: int | None) -> tuple[int, int] | None:
    """Roll back for the bad step of ``record`` (an intervention whose action is rollback).

    Restores model, optimizer, schedule, RNG, step counters, position and detector; adds to
    ``record`` the restored step and the skipped micro-batches; applies ``lr_backoff`` as a
    recorded live edit. Returns where the data resumes ((epoch, micro-batch)), or None when
    there was nothing to roll back to (the bad step stays skipped, as with ``skip``).
    """
    bad_step = record["step"]
    point = ring.before(bad_step) if ring is not None else None
    if point is not None:
        point.restore(run)
        monitor.restore_detector(point.detector)
        source = "memory"
    else:
        if not _from_disk(run, monitor, bad_step):
            log.warning("guard: step %d asks for a rollback but there is no snapshot or checkpoint before it; "
                        "the step stays skipped", bad_step)
            record.update(restored_step=None)
            return None
        source = "checkpoint"
    start = run.position.normalized(batches_per_epoch)
    guard = monitor.guard
    # Past the bad step's last micro-batch, then rollback_skip more.
    resume = advance((record["epoch"], record["batches"][1] + 1), guard.rollback_skip, batches_per_epoch)
    skipped = _index(resume, batches_per_epoch) - _index(start, batches_per_epoch)
    run.position.skipped += skipped
    run.position.epoch, run.position.batch = resume
    step = run.state.global_step
    record.update(restored_step=step, source=source, skipped_from=list(start),
                  skipped_to=list(advance(start, skipped - 1, batches_per_epoch)) if skipped > 0 else None,
                  skipped_batches=skipped)
    record.update(_skipped_samples(monitor, start, skipped))
    if guard.lr_backoff is not None and guard.lr_backoff != 1:
        value = apply_edit(run, "lr_scale", guard.lr_backoff)
        # A live edit like any other: in events and workbench_state.json; the scaled base
        # rates themselves come back with scheduler.pt on resume.
        run.workbench_state.live_edits.append({"step": step, "time": time.time(), "lr_scale": value})
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


def _from_disk(run: Run, monitor: "GuardMonitor", bad_step: int) -> bool:
    """Load the newest verified checkpoint older than ``bad_step``: training state and
    position come back, the run's history (log, live edits, interventions) stays. False when
    there is none."""
    from workbench.checkpoint.store import CheckpointStore
    from workbench.checkpoint.trainer_state import load_training_state

    run.checkpoint_writer.wait()  # a background save still being written may be the one
    store = CheckpointStore(run._get_output_dir(trial=None))
    # The newest one older than the bad step that verifies: a damaged file is never loaded.
    rows = [row for row in store.list() if row.complete and row.step < bad_step]
    path = next((Path(row.path) for row in reversed(rows) if store.problem(row.path) is None), None)
    if path is None:
        return False
    state, extras = run.state, run.workbench_state
    load_training_state(run, path)
    loaded, loaded_extras = run.state, run.workbench_state
    run.state, run.workbench_state = state, extras  # the run's history stays
    state.global_step, state.epoch = loaded.global_step, loaded.epoch
    monitor.restore_detector(loaded_extras.guard or {})
    run.position = resume_position(loaded_extras, loaded.global_step, run.updates_per_epoch,
                                   run.args.gradient_accumulation_steps)
    return True


def resume_position(saved: Any, global_step: int, updates_per_epoch: int | None, accumulation: int) -> LoopPosition:
    """Where a run resumed from a checkpoint goes on: the position it saved, else (an older
    checkpoint, or one transformers wrote) the one its step implies, as HF computes it:
    finished epochs are not repeated, and the current one skips the micro-batches of the
    steps taken in it."""
    position = LoopPosition.restore(getattr(saved, "position", None))
    if position is not None:
        return position
    data = ((getattr(saved, "guard", None) or {}).get("data")) or {}  # before the position had its own field
    if data.get("position"):
        epoch, batch = data["position"]
        return LoopPosition(epoch=int(epoch), batch=int(batch), update=global_step, skipped=int(data.get("skipped", 0)))
    if not updates_per_epoch:
        return LoopPosition(epoch=0, batch=global_step * accumulation, update=global_step)
    return LoopPosition(epoch=global_step // updates_per_epoch,
                        batch=(global_step % updates_per_epoch) * accumulation, update=global_step)
