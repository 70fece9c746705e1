"""A Session's run changed while it trains and carried across restarts: a live edit followed
by a kill and a resume reproduces the edited run, max_steps and epoch edits past the plan,
resume_from and branch, and a training exception surfacing in status, snapshot, wait() and
events.

Every test trains for real in the Session's worker thread; every wait has a deadline.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

from workbench import Session, Trainer, TrainingArguments
from workbench.core.event_file import read_events
from workbench.models import MLPClassifier

from support import DEADLINE, assert_same_weights, finish, wait_until
from support.lm import lm_data, lm_trainer, mlp_data
from support.steering import BeginSteps, PauseAt, StopSessionAt, assert_same_optimizer_state, loss_logs

# ------------------------------------------------- 4. live edit, kill, resume = the edited run


def test_live_lr_edit_then_kill_and_resume_reproduces_the_edited_run(tmp_path, sessions):
    k, stop_at, steps = 8, 13, 30
    common = dict(max_steps=steps, save_strategy="steps", save_steps=5, logging_steps=5, dropout=0.1)

    def edited_session(out, *extra) -> tuple[Session, Trainer]:
        pause = PauseAt(k)
        trainer = lm_trainer(out, callbacks=[pause, *extra], **common)
        session = Session(trainer)
        sessions.append(session)
        for cb in (pause, *extra):
            cb.session = session
        session.start()
        wait_until(lambda: session.status == "paused", f"the pause at step {k}")
        assert trainer.state.global_step == k
        assert session.set(learning_rate=1e-3) == {"learning_rate": 1e-3}
        session.resume()
        return session, trainer

    session_a, trainer_a = edited_session(tmp_path / "a")
    assert finish(session_a) == "finished"

    out_b = tmp_path / "b"
    session_b, trainer_b = edited_session(out_b, StopSessionAt(stop_at))
    assert finish(session_b) == "stopped"
    saved = trainer_b.state.global_step
    assert k < saved < steps
    ckpt = out_b / f"checkpoint-{saved}"
    state = json.loads((ckpt / "workbench_state.json").read_text())  # trainer_state.json stays HF's
    assert [(e["step"], e["learning_rate"]) for e in state["live_edits"]] == [(k, 1e-3)]
    edits = [e for e in read_events(out_b) if e["event"] == "edit"]
    assert len(edits) == 1 and edits[0]["step"] == k and edits[0]["learning_rate"] == 1e-3

    # A new process would build everything again: a fresh trainer, resuming from disk.
    resumed_trainer = lm_trainer(out_b, **common)
    starts = BeginSteps()
    resumed_trainer.add_callback(starts)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert starts.starts == [saved]
    assert resumed_trainer.state.global_step == steps
    assert_same_weights(session_a.model, resumed.model)
    assert_same_optimizer_state(trainer_a, resumed_trainer)
    logs_a, logs_b = loss_logs(trainer_a), loss_logs(resumed_trainer)
    assert [e["step"] for e in logs_a] == [e["step"] for e in logs_b] == [5, 10, 15, 20, 25, 30]
    for a, b in zip(logs_a, logs_b):
        if a["step"] == 15:  # as in HF, the first log after a resume averages only the steps since
            a, b = {**a, "loss": None}, {**b, "loss": None}
        assert a == b


def _small_train(batches: int = 10):
    train, _ = lm_data()
    return Subset(train, range(batches * 8))  # `batches` steps per epoch at batch size 8


def test_max_steps_edit_beyond_the_planned_epochs_runs_to_the_new_end(tmp_path, sessions):
    # 10 steps per epoch, 15 planned (2 epochs); raised live to 26, which needs a third epoch.
    pause = PauseAt(4)
    trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, callbacks=[pause])
    session = Session(trainer)
    pause.session = session
    sessions.append(session)
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 4")
    session.set(max_steps=26)
    session.resume()
    assert finish(session) == "finished"
    assert trainer.state.global_step == 26


def test_num_train_epochs_edit_converts_with_the_planned_epoch_length(tmp_path, sessions):
    # 10 steps per epoch; max_steps 15 (so max_steps / num_train_epochs = 7.5 is no epoch length).
    pause, stop = PauseAt(4), StopSessionAt(7)
    trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50,
                         callbacks=[pause, stop])
    session = Session(trainer)
    pause.session = stop.session = session
    sessions.append(session)
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 4")
    assert session.set(num_train_epochs=3) == {"num_train_epochs": 3}
    assert trainer.state.max_steps == 30 and trainer.state.num_train_epochs == 3
    session.resume()
    assert finish(session) == "stopped"
    resumed_trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert resumed_trainer.state.global_step == 30
    assert resumed.snapshot().edits[-1]["num_train_epochs"] == 3  # the resumed session shows the edit


def test_max_steps_edit_survives_kill_and_resume(tmp_path, sessions):
    pause, stop = PauseAt(4), StopSessionAt(7)
    trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50,
                         callbacks=[pause, stop])
    session = Session(trainer)
    pause.session = stop.session = session
    sessions.append(session)
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 4")
    session.set(max_steps=26)
    session.resume()
    assert finish(session) == "stopped"
    assert trainer.state.global_step == 7 and (tmp_path / "checkpoint-7").is_dir()

    resumed_trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert resumed_trainer.state.global_step == 26 == resumed_trainer.state.max_steps


# ----------------------------------------------------------------- 5. resume_from and branch


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_resume_from_and_branch(tmp_path, sessions):
    out = tmp_path / "main"
    stop, starts = StopSessionAt(12), BeginSteps()
    trainer = lm_trainer(out, max_steps=20, save_strategy="steps", save_steps=5, logging_steps=5,
                         lr_scheduler_type="constant", callbacks=[stop, starts])
    session = Session(trainer)
    stop.session = session
    sessions.append(session)
    assert finish(session.start()) == "stopped"
    assert trainer.state.global_step == 12
    ckpt = out / "checkpoint-10"
    assert ckpt.name in [c.name for c in session.checkpoints]

    # resume_from: the same session restarts from step 10 (not 12) and finishes.
    session.resume_from(ckpt)
    assert finish(session) == "finished"
    assert starts.starts == [0, 10]
    assert trainer.state.global_step == 20
    assert [e["step"] for e in loss_logs(trainer)] == [5, 10, 15, 20]
    assert session.snapshot().step == 20 and session.snapshot().status == "finished"

    # branch: a new session from checkpoint-10 into another folder, with another LR.
    before = _tree(out)
    branch_dir = tmp_path / "branch"
    branch = session.branch(ckpt, output_dir=branch_dir, learning_rate=1e-3)
    sessions.append(branch)
    assert isinstance(branch, Session) and branch is not session
    assert branch.trainer.args.learning_rate == 1e-3 and branch.trainer.args.output_dir == str(branch_dir)
    assert finish(branch.start()) == "finished"
    assert starts.starts[-1] == 10
    btrainer = branch.trainer
    assert btrainer.state.global_step == 20
    assert {e["learning_rate"] for e in loss_logs(btrainer) if e["step"] > 10} == {1e-3}
    assert btrainer.get_learning_rates() == [1e-3] * len(btrainer.optimizer.param_groups)
    events = read_events(branch_dir)
    origin = [e for e in events if e["event"] == "branch"]
    assert len(origin) == 1
    assert origin[0]["checkpoint"] == str(ckpt.resolve())
    assert origin[0]["parent_output_dir"] == str(out.resolve())
    assert origin[0]["overrides"] == {"learning_rate": 1e-3}
    assert sorted(p.name for p in branch_dir.glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-20"]
    assert _tree(out) == before, "the branch wrote into the original output_dir"
    # The original session's model is its own: the branch trained a copy.
    assert session.model is not branch.model
    assert not all(torch.equal(a, b) for a, b in zip(session.model.parameters(), branch.model.parameters()))


# ------------------------------------------------------------------- 6. a training exception


class BoomError(RuntimeError):
    pass


class ExplodingMLP(MLPClassifier):
    """Raises in the forward of its third training step."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.train_calls = 0

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        if self.training:
            self.train_calls += 1
            if self.train_calls == 3:
                raise BoomError("the forward exploded at step 3")
        return super().forward(x, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)


def test_training_exception_surfaces_in_status_snapshot_wait_and_events(tmp_path, sessions):
    train, evals = mlp_data()
    torch.manual_seed(0)
    args = TrainingArguments(str(tmp_path), max_steps=10, per_device_train_batch_size=8, logging_steps=1,
                             report_to="none", disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=ExplodingMLP(), args=args, train_dataset=train, eval_dataset=evals)
    session = Session(trainer)
    sessions.append(session)
    q = session.subscribe()
    session.start()
    with pytest.raises(BoomError, match="exploded at step 3"):
        session.wait(DEADLINE)
    assert not session._thread.is_alive()
    assert session.status == "failed"
    assert isinstance(session.error, BoomError)
    snap = session.snapshot()
    assert snap.status == "failed" and snap.error.startswith("BoomError") and "step 3" in snap.error
    assert snap.step == 2
    kinds = []
    while True:
        try:
            kinds.append(q.get(timeout=5))
        except queue.Empty:
            break
        if kinds[-1].kind == "failed":
            break
    failed = [e for e in kinds if e.kind == "failed"]
    assert len(failed) == 1 and "BoomError" in failed[0].data["error"]
    # events() on a failed run ends instead of blocking; the event log has the error.
    assert list(session.events()) == []
    assert [e["event"] for e in read_events(tmp_path)][-1] == "error"
    with pytest.raises(BoomError):  # and wait() keeps re-raising it
        session.wait(1)
