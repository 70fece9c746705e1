"""A fork's variant saved on purpose (issue 28): its end state as a checkpoint in a folder of
its own, while the run stays at its pause and the fork stays undecided.

The checkpoint is the one a run that had kept the variant would write at the variant's last
step: weights, optimizer, schedule, RNG, data position, the variant's change among the live
edits (with a record naming the fork, as ``keep`` adds), the loss not logged yet (the
variant's steps since its last logging point among it), and its tokens and FLOP counted. So a
run resumed from it (``--resume FOLDER/checkpoint-N``, ``Trainer.train(resume_from_checkpoint=...)``,
``session.branch(...)``) continues bitwise as the kept run would. What it leaves out: the log
records of the variant's own logging points (``log_history`` ends at the pause; the variant's
per-step losses and evaluation are in the fork report).

Nothing of the run changes: everything the save reads or sets (the boundary, the counters,
the loss window, the guard's rollback ring, the loop's collated-ahead batches) is put back.
Every rank runs it at the same point (rank 0's Session orders it at the paused ranks'
heartbeat), so the save's collectives meet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.core.names import PREFIX_CHECKPOINT_DIR
from workbench.train.forking import Boundary, KeptStep, count_kept_steps

if TYPE_CHECKING:
    from workbench.core.run import Run

__all__ = ["save_variant", "saved_record"]


def save_variant(run: "Run", end: Boundary, folder: Path, why: str, record: dict[str, Any]) -> Path:
    """Write ``end`` (a variant's end state) as ``folder/checkpoint-<step>`` and put the run
    back where it is. ``why`` replaces the reason of the variant's change records (as keep's
    reason does) and ``record`` (naming the fork and the variant) follows them. Returns the
    checkpoint's path."""
    from workbench.checkpoint.trainer_state import save_checkpoint

    loop, state, own = run.loop, run.state, run.workbench_state
    here = Boundary.take(run)
    counters = (state.total_flos, state.num_input_tokens_seen, state.stateful_callbacks, run.current_flos)
    saved_fields = (own.loss_window, own.guard, own.position, own.memory)
    losses, tokens, collation = loop.losses, loop._tokens, loop.collation
    guard = loop.guard
    ring = getattr(guard, "ring", None)
    try:
        before = len(here.live_edits)
        end.restore(run)
        for change in run.workbench_state.live_edits[before:]:
            change["reason"] = why
        run.workbench_state.live_edits.append(dict(record))
        loop.losses, loop._tokens = _counted(run, losses, tokens, end.steps)
        # The variant's batches came from an iterator of its own: none the loop collated ahead
        # belongs to its end (a run resumed from it collates afresh, as a kept variant does).
        loop.collation = None
        if ring is not None:  # the variant's state must never become a point the run rolls back to
            guard.ring = None
        save_checkpoint(run, folder=folder)
    finally:
        if ring is not None:
            guard.ring = ring
        loop.losses, loop._tokens, loop.collation = losses, tokens, collation
        here.restore(run)
        state.total_flos, state.num_input_tokens_seen, state.stateful_callbacks, run.current_flos = counters
        own.loss_window, own.guard, own.position, own.memory = saved_fields
    return Path(folder) / f"{PREFIX_CHECKPOINT_DIR}-{end.point.step}"


def _counted(run: "Run", losses: Any, tokens: Any, steps: list[KeptStep]) -> tuple[Any, Any]:
    """Copies of the loop's loss log and token count with the variant's steps in them, as
    ``keep`` hands them to the loop (forking.log_kept_steps), but silent: at a logging point the
    window starts anew and nothing is logged. The FLOP go to ``run.current_flos`` (put back by
    the caller)."""
    window, counted = losses.copy(), tokens.clone()

    def each(_kept: KeptStep, logs: bool) -> None:
        if logs:
            window.skip_log()

    count_kept_steps(run, steps, window, counted, each)
    return window, counted


def saved_record(report: dict[str, Any], name: str, folder: Path, why: str) -> dict[str, Any]:
    """The live-edit record a saved variant's checkpoint ends with (as keep's ``kept``)."""
    return {"step": report["variants"][name]["end_step"], "time": time.time(), "reason": why,
            "fork": {"id": report["id"], "saved": name, "from_step": report["step"], "steps": report["steps"],
                     "folder": str(folder)}}
