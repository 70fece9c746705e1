"""Nothing saved is lost or overwritten (issue 24, items 1-5).

1. ``--resume`` when no checkpoint verifies refuses (exit 2, one line naming them) and touches
   nothing; a checkpoint that fails verification is never overwritten (a re-save of its step
   keeps it under another name) nor deleted by rotation.
2. and 3. A remote ``resume_from`` or ``branch`` is checked whole before anything stops: the
   checkpoint is this run's, complete, verified and fits the model; a branch's folder is new
   or empty.
4. SIGHUP (a closed terminal) takes SIGTERM's path: a checkpoint, an ``end`` record, exit 129.
5. A guard whose rollbacks or skips make no progress escalates instead of looping forever,
   and its events are bounded per minute.

The in-process tests check the rules; the slow ones run ``workbench`` as a user does.
"""

from __future__ import annotations

import os

import pytest
import torch

from workbench import Trainer
from workbench.checkpoint.store import CheckpointStore
from workbench.data.builtin import TensorDictDataset

from support import make_args, tiny_gpt, wait_until
from support.damage import flip_byte, tree_digest

VOCAB, SEQ = 40, 12
_ids = torch.randint(0, VOCAB, (48, SEQ), generator=torch.Generator().manual_seed(0))
TRAIN = TensorDictDataset(input_ids=_ids, labels=_ids.clone())


def tiny(out, resume=None, **overrides) -> Trainer:
    model = tiny_gpt(0, vocab_size=VOCAB, block_size=SEQ)
    options = dict(max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="steps",
                   save_steps=2, seed=1)
    options.update(overrides)
    trainer = Trainer(model=model, args=make_args(out, **options), train_dataset=TRAIN)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


# -- 1. damaged checkpoints ------------------------------------------------------------------------


def test_resume_true_with_every_checkpoint_damaged_names_them_and_changes_nothing(tmp_path):
    out = tmp_path / "out"
    tiny(out)
    for step in (2, 4, 6):
        flip_byte(out / f"checkpoint-{step}" / "model.safetensors")
    before = tree_digest(out)
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory .*none verifies: "
                                         r"checkpoint-6 \(model.safetensors does not match its sha256\), "
                                         r"checkpoint-4 .*checkpoint-2 "):
        tiny(out, resume=True)
    assert tree_digest(out) == before


def test_a_resave_over_a_damaged_checkpoint_keeps_it_and_rotation_spares_damaged_ones(tmp_path, caplog):
    full = tiny(tmp_path / "full", max_steps=8)
    out = tmp_path / "out"
    tiny(out, max_steps=8, save_total_limit=10)
    damaged = out / "checkpoint-6" / "model.safetensors"
    flip_byte(damaged)
    kept = damaged.read_bytes()
    (out / "checkpoint-2" / "optimizer.pt").write_bytes(b"truncated")  # an old one, damaged by size
    (out / "checkpoint-8").rename(tmp_path / "gone-8")  # the newest good one is gone

    resumed = tiny(out, resume=True, max_steps=8, save_total_limit=2)  # from checkpoint-4, past the damaged 6
    aside = [p for p in out.iterdir() if p.name.startswith("checkpoint-6.damaged-")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").read_bytes() == kept
    assert "checkpoint-6 failed verification (model.safetensors does not match its sha256): kept as" in caplog.text
    store = CheckpointStore(out)
    # rotation to 2 deleted the sound checkpoint-4 and left the damaged checkpoint-2 alone
    assert [r.name for r in store.list()] == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
    assert store.problem(out / "checkpoint-2") is not None
    assert store.verify(out / "checkpoint-8") == (True, None)
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


# -- 2. and 3. remote restarts and branches, checked before anything stops -----------------------------


# -- 4. a closed terminal ----------------------------------------------------------------------------


# -- 5. a guard that makes no progress -----------------------------------------------------------------


@pytest.mark.parametrize("action", ["rollback", "skip"])
def test_a_guard_getting_nowhere_stops_a_headless_run_with_a_checkpoint(tmp_path, action):
    """Every step non-finite: rollbacks go back to the same snapshot, skips accept nothing.
    After ``max_no_progress`` the run stops with a checkpoint of finite weights, and the
    record says why; it used to roll back forever (epoch 155 after 5 minutes)."""
    from workbench import Guard
    from workbench.core.event_file import read_events

    from support.guarded import N, Poisoned, run
    from support.guarded import weights as guard_weights

    guard = Guard(nonfinite=action, snapshot_every=4, max_no_progress=3)
    trainer, order = run(tmp_path / "run", Poisoned(nan_ids=range(N)), guard, max_steps=10_000, logging_steps=1)
    assert len(order.steps) <= 6  # three bad steps, then the stop (a rollback repeats the restored step)
    saved = trainer.workbench_state.guard
    expected = ("3 rollbacks to step 0 without getting past it" if action == "rollback" else
                "3 interventions in a row without an accepted step (nonfinite, steps 1-3)")
    assert saved["progress"]["escalated"] == expected
    events = read_events(tmp_path / "run")
    assert [e["reason"] for e in events if e["event"] == "guard_escalated"] == [expected]
    end = events[-1]
    assert (end["event"], end["stop_reason"], end["saved"]) == ("end", "guard", True)
    assert CheckpointStore(tmp_path / "run").latest_verified().step == trainer.state.global_step
    assert all(torch.isfinite(w).all() for w in guard_weights(trainer))


def test_an_interactive_run_pauses_and_gets_as_many_tries_again(tmp_path):
    from workbench import Guard, Session
    from workbench.door.protocol import Status

    from support.guarded import BATCH, N, Poisoned, Regression

    trainer = Trainer(model=Regression(), train_dataset=Poisoned(nan_ids=range(N)),
                      args=make_args(tmp_path / "s", max_steps=100, per_device_train_batch_size=BATCH, seed=3))
    session = Session(trainer, guard=Guard(nonfinite="skip", max_no_progress=4), control=False)
    try:
        session.start()
        wait_until(lambda: session.status in (Status.PAUSED, Status.FINISHED, Status.FAILED), "the guard's pause", 60)
        assert session.status == Status.PAUSED
        assert session.snapshot().step == 4
        session.resume()
        wait_until(lambda: session.snapshot().step >= 8 and session.status == Status.PAUSED, "the second pause", 60)
        assert session.snapshot().step == 8
    finally:
        session.stop(save=False)
        session.resume()
        session.wait(60)
        session.close()


def test_guard_events_are_bounded_per_minute_with_a_summary(tmp_path):
    """200 bad steps within a minute: 60 ``guard`` lines, then one ``guard_summary`` with the
    rest counted; every intervention stays in workbench_state."""
    from workbench import Guard
    from workbench.core.event_file import read_events

    from support.guarded import N, Poisoned, run

    trainer, _ = run(tmp_path / "run", Poisoned(nan_ids=range(N)), Guard(nonfinite="skip", max_no_progress=None),
                     max_steps=200, logging_steps=50)
    events = read_events(tmp_path / "run")
    guard_lines = [e for e in events if e["event"] == "guard"]
    summaries = [e for e in events if e["event"] == "guard_summary"]
    assert len(guard_lines) == 60 and [e["step"] for e in guard_lines] == list(range(1, 61))
    assert len(summaries) == 1
    assert summaries[0]["count"] == 140 and summaries[0]["left_out"] == {"nonfinite": 140}
    assert summaries[0]["steps"] == [61, 200]
    assert len(trainer.workbench_state.guard["interventions"]) == 200


def test_a_terminal_is_gone_once_its_other_end_closes_and_nothing_else_ever_is(tmp_path):
    import pty

    from workbench.cli.hangup import terminal_gone

    master, slave = pty.openpty()
    try:
        assert not terminal_gone(slave)
        os.close(master)
        assert terminal_gone(slave)  # still a character device, no longer a tty: reads end, writes fail
    finally:
        os.close(slave)
    with open(tmp_path / "log.txt", "w") as f, open(os.devnull, "w") as null:
        assert not terminal_gone(f.fileno()) and not terminal_gone(null.fileno())
    read_end, write_end = os.pipe()
    assert not terminal_gone(write_end)
    os.close(read_end), os.close(write_end)
