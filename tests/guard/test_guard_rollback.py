"""The guard's rollback: a snapshot restored and the bad data moved past, a long rollback
counted, not listed, the learning-rate back-off as a recorded live edit, bitwise resume after
a rollback and from a save between a snapshot and the bad step, an epoch-end save that reads
the guard first, and an empty ring rolling back from the newest checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from workbench import Guard
from workbench.core.event_file import read_events

from support import StopAt
from support.guarded import Poisoned, clean_order, run, weights

# --------------------------------------------------------------------------- rollback

# Snapshots at steps 0, 4, 8...; a log (a read point) every 4 steps; the spike at step 6 is
# read at step 8, so steps 5-8 are undone and the data resumes past batch 5 plus one more.
ROLLBACK = Guard(nonfinite="rollback", spike="rollback", spike_factor=20.0, window=4, snapshot_every=4,
                 snapshots=2, rollback_skip=1)


def guard_events(out) -> list[dict]:
    return [e for e in read_events(out) if e["event"] == "guard"]


def test_rollback_restores_a_snapshot_and_moves_past_the_bad_data(tmp_path, checks):
    steps = clean_order(tmp_path)
    nan_sample = steps[5][0]  # step 6 (micro-batch 5 of epoch 0)
    data = Poisoned(nan_ids=[nan_sample])
    trainer, order = run(tmp_path / "run", data, ROLLBACK, max_steps=12, logging_steps=4)
    assert trainer.state.global_step == 12
    assert all(torch.isfinite(w).all() for w in weights(trainer))
    (event,) = guard_events(tmp_path / "run")
    assert (event["step"], event["kind"], event["action"], event["batches"]) == (6, "nonfinite", "rollback", [5, 5])
    assert (event["restored_step"], event["source"]) == (4, "memory")
    # batches 4 (undone step 5), 5 (the bad one) and 6 (rollback_skip) are never trained again
    assert (event["skipped_from"], event["skipped_to"], event["skipped_batches"]) == ([0, 4], [0, 6], 3)
    assert event["samples"] == steps[5]
    skipped = [i for ids in steps[4:7] for i in ids]
    assert (event["skipped_samples"], event["skipped_sample_count"]) == (skipped, 12)
    after = [i for ids in order.steps[8:] for i in ids]
    assert not set(event["skipped_samples"]) & set(after)  # named rows never come back
    # a run's recording (`workbench watch`) lists it as the live snapshot would
    from workbench.control.watch import open_watch

    (mark,) = open_watch(tmp_path / "run").snapshot().interventions
    assert (mark.step, mark.action, mark.restored_step, mark.skipped_samples, mark.samples) == \
        (6, "rollback", 4, 12, tuple(steps[5]))
    # 8 steps ran before the rollback was read, then steps 5-12 on batches 7-14
    assert order.steps[:8] == steps[:8]
    assert order.steps[8:] == steps[7:15]
    seen = [i for ids in order.steps for i in ids]
    assert seen.count(nan_sample) == 1  # the bad sample is never replayed
    for ids in steps[4:7]:  # trained once before the rollback, never after it
        assert all(seen.count(i) == 1 for i in ids)
    position = trainer.position  # the data offset is the loop's position (core/run.py)
    assert (position.skipped, position.epoch, position.batch) == (3, 0, 15)


def test_a_long_rollback_keeps_the_count_not_the_list(tmp_path, monkeypatch):
    import workbench.guard.rollback as rollback

    steps = clean_order(tmp_path)
    monkeypatch.setattr(rollback, "MAX_LISTED_SAMPLES", 11)  # this rollback skips 12 rows
    run(tmp_path / "run", Poisoned(nan_ids=[steps[5][0]]), ROLLBACK, max_steps=12, logging_steps=4)
    (event,) = guard_events(tmp_path / "run")
    assert (event["skipped_samples"], event["skipped_sample_count"]) == (None, 12)
    assert (event["skipped_from"], event["skipped_to"]) == ([0, 4], [0, 6])  # the range stands for them
    assert event["samples"] == steps[5]  # the bad step's own rows are always named


def test_rollback_lr_backoff_is_a_recorded_live_edit(tmp_path):
    steps = clean_order(tmp_path)
    guard = dataclasses.replace(ROLLBACK, lr_backoff=0.5)
    trainer, _ = run(tmp_path / "run", Poisoned(nan_ids=[steps[5][0]]), guard, max_steps=12, logging_steps=4,
                     lr_scheduler_type="constant")
    assert trainer.lr_scheduler.base_lrs == [0.025] and trainer.get_learning_rates()[0] == 0.025
    assert [(e["step"], e["lr_scale"]) for e in trainer.workbench_state.live_edits] == [(4, 0.5)]
    assert guard_events(tmp_path / "run")[0]["lr_scale"] == 0.5


def test_resume_after_a_rollback_is_bitwise_equal(tmp_path):
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[5][0]])
    whole, whole_order = run(tmp_path / "whole", data, ROLLBACK, max_steps=12, logging_steps=4)
    out = tmp_path / "parts"
    # stopped at step 10 after the rollback (8 steps, back to 4, then 5-10): checkpoint-10
    first, _ = run(out, data, ROLLBACK, callbacks=[StopAt(10)], max_steps=12, logging_steps=4)
    assert [e["action"] for e in guard_events(out)] == ["rollback"]
    resumed, resumed_order = run(out, data, ROLLBACK, resume=True, max_steps=12, logging_steps=4)
    assert resumed_order.steps == whole_order.steps[-2:]  # the data order carries on past the skip
    assert resumed.state.global_step == whole.state.global_step == 12
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)
    assert resumed.workbench_state.guard["interventions"] == whole.workbench_state.guard["interventions"]
    assert resumed.position == whole.position  # the data offset: the loop's position


def test_resume_from_a_save_between_a_snapshot_and_the_bad_step_is_bitwise_equal(tmp_path):
    # save_steps 5 and snapshot_every 4 do not line up. A run resumed from checkpoint-5 has
    # an empty ring, so the bad step 6 (read at 8) rolls it back to checkpoint-5; the
    # uninterrupted run must go back to step 5 as well (its save there is a snapshot point),
    # not to its periodic snapshot at 4. (Found by a SIGKILL on the CLI: tests/test_guard_kill.py.)
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[5][0]])
    options = dict(max_steps=12, logging_steps=4, save_strategy="steps", save_steps=5)
    whole, whole_order = run(tmp_path / "whole", data, ROLLBACK, **options)
    out = tmp_path / "parts"
    run(out, data, ROLLBACK, callbacks=[StopAt(5)], **options)
    assert guard_events(out) == []
    resumed, resumed_order = run(out, data, ROLLBACK, resume=True, **options)
    (memory,), (disk,) = guard_events(tmp_path / "whole"), guard_events(out)
    assert (memory["restored_step"], memory["source"]) == (5, "memory")
    assert (disk["restored_step"], disk["source"]) == (5, "checkpoint")
    same = ("step", "kind", "action", "batches", "samples", "skipped_from", "skipped_to", "skipped_samples")
    assert {k: memory[k] for k in same} == {k: disk[k] for k in same}
    assert resumed_order.steps == whole_order.steps[5:]
    assert resumed.state.global_step == whole.state.global_step == 12
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)
    assert resumed.position == whole.position  # the data offset: the loop's position


def test_an_epoch_end_save_reads_the_guard_first(tmp_path):
    # save_strategy "epoch" asks for the save after the last step's own read point. The bad
    # last step of epoch 0 used to be found by the save itself, which cannot roll back: the
    # checkpoint held a rollback never carried out, and a resume from it never did it either.
    import shutil

    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[15][0]])  # step 16, the last of epoch 0 (and again each epoch)
    guard = dataclasses.replace(ROLLBACK, snapshot_every=5, rollback_skip=0)
    options = dict(max_steps=40, logging_steps=100, save_strategy="epoch")
    whole, _ = run(tmp_path / "whole", data, guard, **options)
    first = guard_events(tmp_path / "whole")[0]
    assert (first["step"], first["action"], first["restored_step"]) == (16, "rollback", 15)
    checkpoints = sorted((tmp_path / "whole").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in checkpoints] == ["checkpoint-27", "checkpoint-40"]  # step 16's save was undone too
    import json

    for path in checkpoints:
        records = json.loads((path / "workbench_state.json").read_text())["guard"]["interventions"]
        assert all(r.get("restored_step") is not None for r in records if r["action"] == "rollback"), path.name
    shutil.copytree(checkpoints[0], tmp_path / "parts" / checkpoints[0].name)
    resumed, _ = run(tmp_path / "parts", data, guard, resume=True, **options)
    assert resumed.state.global_step == whole.state.global_step == 40
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)


def test_empty_ring_rolls_back_from_the_newest_checkpoint(tmp_path):
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[5][0]])
    # In memory: snapshots at 0, 3, 6; the bad step 6 is read at 6 and rolls back to 3.
    memory_guard = dataclasses.replace(ROLLBACK, snapshot_every=3)
    memory, memory_order = run(tmp_path / "memory", data, memory_guard, max_steps=12, logging_steps=4)
    assert [(e["restored_step"], e["source"]) for e in guard_events(tmp_path / "memory")] == [(3, "memory")]
    # From disk: a run resumed at checkpoint-3 holds no snapshot (the next is at 100), so the
    # bad step (read at 8) rolls back to checkpoint-3, the same state as the snapshot.
    disk_guard = dataclasses.replace(ROLLBACK, snapshot_every=100)
    out = tmp_path / "disk"
    run(out, data, disk_guard, callbacks=[StopAt(3)], max_steps=12, logging_steps=4)
    disk, disk_order = run(out, data, disk_guard, resume=True, max_steps=12, logging_steps=4)
    (event,) = guard_events(out)
    assert (event["restored_step"], event["source"], event["skipped_from"], event["skipped_to"]) == \
        (3, "checkpoint", [0, 3], [0, 6])
    assert disk_order.steps[5:] == memory_order.steps[-9:] == steps[7:16]
    assert disk.state.global_step == 12
    for a, b in zip(weights(memory), weights(disk)):
        assert torch.equal(a, b)


def test_a_point_restored_twice_gives_the_same_state_both_times(tmp_path):
    """Restoring hands the optimizer and the schedule copies: the steps after a first rollback
    must not write into the point a second rollback to it reads (on the CPU, load_state_dict
    keeps the tensors it is given)."""
    from workbench.guard.ring import RollbackPoint

    trainer, _ = run(tmp_path / "run", Poisoned(), None, max_steps=4, logging_steps=4)
    model, optimizer = trainer.model, trainer.optimizer

    def train_a_step() -> None:
        loss = sum((p.float() ** 2).sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
        trainer.lr_scheduler.step()
        optimizer.zero_grad()

    point = RollbackPoint.take(trainer, {})
    saved = copy.deepcopy((point.optimizer, point.scheduler))
    for _ in range(2):
        for _ in range(3):
            train_a_step()
        point.restore(trainer)
        restored = optimizer.state_dict()
        for key, state in saved[0]["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(restored["state"][key][name]), torch.as_tensor(value)), name
        assert trainer.lr_scheduler.state_dict()["last_epoch"] == saved[1]["last_epoch"]
