"""A guard rollback undoes steps' compute time wherever the loop reads the guard: at a step end
and at an epoch end (train/loop.py ``_read_guard``), the undone steps' seconds are booked as
rolled back (core/ledger.py), not as compute, and the ledger still adds up to its wall time."""

from __future__ import annotations

import pytest

from workbench import Guard

from support.guarded import BATCH, N, Poisoned, clean_order, run


def test_a_rollback_read_at_an_epoch_end_books_the_undone_steps_as_rolled_back(tmp_path):
    per_epoch = N // BATCH  # 16 steps an epoch
    bad_step = per_epoch  # the epoch's last step
    bad = clean_order(tmp_path)[bad_step - 1][0]
    # Nothing reads the guard at that step's end (no log, save or rollback point due there):
    # the epoch-end save does, and rolls back to the point of step 15.
    guard = Guard(nonfinite="rollback", snapshot_every=5)
    # 4 steps into the next epoch: the bad row comes round again later in it (step 24), past the end.
    trainer, _ = run(tmp_path / "run", Poisoned(nan_ids=[bad]), guard, max_steps=per_epoch + 4, logging_steps=100,
                     save_strategy="epoch")
    interventions = trainer.workbench_state.guard["interventions"]
    assert [(r["step"], r["action"], r["restored_step"]) for r in interventions] == [(bad_step, "rollback", 15)]
    summary = trainer.ledger.summary()
    assert summary["rolled_back"] > 0  # step 16's compute, undone (the only rollback of the run)
    assert sum(v for k, v in summary.items() if k != "wall") == pytest.approx(summary["wall"], abs=1e-3)
    assert trainer.state.global_step == per_epoch + 4
