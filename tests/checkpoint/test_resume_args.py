"""Resuming with changed arguments (train/resume_args.py).

A checkpoint saved with save_steps=2, learning_rate=0.1 and resumed with save_steps=3,
learning_rate=0.5 must save every 3 steps at base LR 0.5 from the resume step, print one
warning per difference, and record the change as a live edit, through a new Trainer, the
CLI (``--resume --set``) and ``Session.resume_from(checkpoint, **overrides)``. Real runs of
a tiny model on the CPU; nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import Session, Trainer, TrainerCallback, TrainingArguments
from workbench.core.event_file import read_events
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier
from workbench.train.resume_args import COMPARED, replace_arguments

from support import checkpoint_steps, hf_logs

STOP = 4  # the first run stops (and is resumed) here
WARNING_PREFIX = f"resuming from checkpoint-{STOP}:"


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class StepRates(TrainerCallback):
    """The optimizer's learning rates each step runs with, by step."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.rates: dict[int, list[float]] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.rates[state.global_step] = [g["lr"] for g in self.trainer.optimizer.param_groups]


def make_args(out: Path, **overrides: Any) -> TrainingArguments:
    options = {
        "output_dir": str(out),
        "disable_tqdm": True,
        "report_to": "none",
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "max_steps": 12,
        "save_strategy": "steps",
        "save_steps": 2,
        "learning_rate": 0.1,
        "lr_scheduler_type": "constant",
        "use_cpu": True,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def make_trainer(out: Path, callbacks: list | None = None, **overrides: Any) -> Trainer:
    train, _ = load_builtin_data("random-classification", n_train=64, n_eval=8, in_features=8, num_classes=4)
    torch.manual_seed(0)
    model = MLPClassifier(in_features=8, hidden=16, num_classes=4, n_layer=1)
    return Trainer(model=model, args=make_args(out, **overrides), train_dataset=train, callbacks=callbacks)


def stopped_run(out: Path, **overrides: Any) -> Path:
    """A run saved every 2 steps at LR 0.1 (unless overridden), stopped at step 4: its checkpoint-4."""
    make_trainer(out, callbacks=[StopAt(STOP)], **overrides).train()
    return out / f"checkpoint-{STOP}"


def resume_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "transformers.trainer_utils" and r.levelno == logging.WARNING
            and r.getMessage().startswith("resuming from")]


@pytest.fixture(autouse=True)
def _resume_warnings_reach_caplog(caplog):
    """The warnings are HF's kind, on its ``transformers.trainer_utils`` logger."""
    with hf_logs(caplog, "transformers.trainer_utils"):
        yield


def saved_state(checkpoint: Path) -> dict[str, Any]:
    from workbench.core.state import TrainerState, WorkbenchState

    # trainer_state.json holds HF's fields; the live edits are in workbench_state.json beside it.
    return {**dataclasses.asdict(TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))),
            **dataclasses.asdict(WorkbenchState.load(checkpoint))}


# ------------------------------------------------------------------------- a new Trainer


def test_changed_save_steps_saves_at_the_new_interval(tmp_path):
    ckpt = stopped_run(tmp_path)
    assert checkpoint_steps(tmp_path) == [2, 4]
    trainer = make_trainer(tmp_path, save_steps=3)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 12 and trainer.state.save_steps == 3
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 9, 12]  # not 6, 8, 10, 12


def test_changed_learning_rate_is_the_base_rate_from_the_resume_step(tmp_path):
    ckpt = stopped_run(tmp_path)
    rates = StepRates()
    trainer = make_trainer(tmp_path, callbacks=[rates], learning_rate=0.5)
    rates.trainer = trainer
    trainer.train(resume_from_checkpoint=str(ckpt))
    groups = len(trainer.optimizer.param_groups)
    assert sorted(rates.rates) == list(range(STOP, 12))
    assert all(rates.rates[step] == [0.5] * groups for step in rates.rates)  # the first resumed step too
    assert trainer.lr_scheduler.base_lrs == [0.5] * groups
    assert {e["learning_rate"] for e in trainer.state.log_history if "loss" in e and e["step"] > STOP} == {0.5}


def test_the_new_rate_keeps_the_schedule_position(tmp_path):
    # Linear decay: the schedule's factor at the resume step carries on, scaled to the new base.
    ckpt = stopped_run(tmp_path, lr_scheduler_type="linear")
    rates = StepRates()
    trainer = make_trainer(tmp_path, callbacks=[rates], lr_scheduler_type="linear", learning_rate=0.5)
    rates.trainer = trainer
    trainer.train(resume_from_checkpoint=str(ckpt))
    for step, lrs in rates.rates.items():
        assert lrs[0] == pytest.approx(0.5 * (12 - step) / 12), step


def test_one_warning_per_difference(tmp_path, caplog):
    ckpt = stopped_run(tmp_path)
    trainer = make_trainer(tmp_path, save_steps=3, learning_rate=0.5, per_device_train_batch_size=2)
    trainer.train(resume_from_checkpoint=str(ckpt))
    lines = resume_warnings(caplog)
    assert len(lines) == 3, lines
    by_key = {line.split(": ", 1)[1].split(" ", 1)[0]: line for line in lines}
    assert set(by_key) == {"learning_rate", "save_steps", "per_device_train_batch_size"}
    assert all(line.startswith(WARNING_PREFIX) for line in lines)
    assert "0.5 in this launch but 0.1" in by_key["learning_rate"] and "live edit" in by_key["learning_rate"]
    assert "3 in this launch but 2" in by_key["save_steps"] and "live edit" in by_key["save_steps"]
    # Not editable: only a warning, saying what it means for the data.
    assert "data position may shift" in by_key["per_device_train_batch_size"]
    assert "live edit" not in by_key["per_device_train_batch_size"]
    assert all("\n" not in line for line in lines)


def test_unchanged_arguments_warn_nothing_and_record_nothing(tmp_path, caplog):
    ckpt = stopped_run(tmp_path)
    trainer = make_trainer(tmp_path)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert resume_warnings(caplog) == []
    assert trainer.workbench_state.live_edits == []
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 8, 10, 12]
    assert not [e for e in read_events(tmp_path) if e["event"] == "edit"]


def test_the_change_is_a_recorded_edit_that_a_second_resume_keeps(tmp_path, caplog):
    ckpt = stopped_run(tmp_path)
    first = make_trainer(tmp_path, callbacks=[StopAt(9)], save_steps=3, learning_rate=0.5, max_steps=15)
    first.train(resume_from_checkpoint=str(ckpt))
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 9]
    state = saved_state(tmp_path / "checkpoint-9")
    [record] = state["live_edits"]
    assert {k: v for k, v in record.items() if k != "time"} == {
        "step": STOP, "learning_rate": 0.5, "max_steps": 15, "save_steps": 3}
    assert state["save_steps"] == 3
    edits = [e for e in read_events(tmp_path) if e["event"] == "edit"]
    assert len(edits) == 1 and edits[0]["step"] == STOP and edits[0]["save_steps"] == 3

    # The resumed run's checkpoint, resumed as it was launched: nothing differs, nothing is
    # warned, and the new values carry on (interval 3, base rate 0.5, length 15).
    caplog.clear()
    rates = StepRates()
    second = make_trainer(tmp_path, callbacks=[rates], save_steps=3, learning_rate=0.5, max_steps=15)
    rates.trainer = second
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-9"))
    assert resume_warnings(caplog) == []
    assert second.state.global_step == 15
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 9, 12, 15]
    assert all(lrs == [0.5] * len(lrs) for lrs in rates.rates.values())
    assert [e["step"] for e in second.workbench_state.live_edits] == [STOP]  # the record travels on, once
    assert saved_state(tmp_path / "checkpoint-15")["live_edits"] == state["live_edits"]


def test_a_relaunch_with_the_original_arguments_changes_back_and_says_so(tmp_path, caplog):
    # The reference is the arguments of the launch that wrote the checkpoint: going back to
    # the first launch's arguments is a change like any other.
    ckpt = stopped_run(tmp_path)
    make_trainer(tmp_path, callbacks=[StopAt(6)], save_steps=3).train(resume_from_checkpoint=str(ckpt))
    caplog.clear()
    again = make_trainer(tmp_path)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    [line] = resume_warnings(caplog)
    assert line.startswith("resuming from checkpoint-6: save_steps is 2 in this launch but 3")
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 8, 10, 12]
    assert [(e["step"], e.get("save_steps")) for e in again.workbench_state.live_edits] == [(STOP, 3), (6, 2)]


class EditAt(TrainerCallback):
    """Edits the run through its Session at the end of ``step`` (applied at that step end)."""

    def __init__(self, step: int, **changes: Any) -> None:
        self.step, self.changes, self.session = step, changes, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.session.set(**self.changes)


def test_a_session_edit_survives_a_plain_resume(tmp_path, caplog):
    # A live edit is not a difference of arguments: the same launch again keeps it.
    edit = EditAt(1, save_steps=3)
    session = Session(make_trainer(tmp_path, callbacks=[edit, StopAt(3)]))
    edit.session = session
    session.start()
    assert session.wait(timeout=300) == "stopped"
    assert checkpoint_steps(tmp_path) == [3]  # every 3 steps from the edit on
    assert saved_state(tmp_path / "checkpoint-3")["save_steps"] == 3
    caplog.clear()
    resumed = make_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resume_warnings(caplog) == []
    assert resumed.state.save_steps == 3
    assert checkpoint_steps(tmp_path) == [3, 6, 9, 12]


# ------------------------------------------------------------------- Session.resume_from


def test_session_resume_from_with_overrides(tmp_path, caplog):
    trainer = make_trainer(tmp_path, callbacks=[StopAt(STOP)])
    session = Session(trainer)
    session.start()
    assert session.wait(timeout=300) == "stopped"
    trainer.pop_callback(StopAt)
    session.resume_from(tmp_path / f"checkpoint-{STOP}", save_steps=3, learning_rate=0.5)
    assert session.wait(timeout=300) == "finished"
    assert trainer.args.save_steps == 3 and trainer.args.learning_rate == 0.5
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 9, 12]
    assert trainer.lr_scheduler.base_lrs == [0.5] * len(trainer.optimizer.param_groups)
    assert sorted(line.split(": ", 1)[1].split(" ", 1)[0] for line in resume_warnings(caplog)) == [
        "learning_rate", "save_steps"]
    assert session.snapshot().edits[-1]["save_steps"] == 3  # the session shows the edit


def test_only_compared_arguments_can_be_replaced_on_a_trainer(tmp_path):
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="output_dir: cannot change"):
        replace_arguments(trainer, output_dir=str(tmp_path / "other"))
    with pytest.raises(ValueError):  # validated as a new TrainingArguments would be
        replace_arguments(trainer, save_steps=-3)
    replace_arguments(trainer, per_device_train_batch_size=2)
    assert trainer._train_batch_size == 2 and "per_device_train_batch_size" in COMPARED


# ------------------------------------------------------------------------------ the CLI
