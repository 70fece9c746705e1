"""One training run at a time in a process (workbench/train/one_run.py).

Found in the notebook browser test: a cell pressed twice started a second run in the kernel,
and a fork's evaluation in the first then trimmed its batches by the second run's training
loader (Accelerate's GradientState is process-wide): predictions of 60 rows against labels of
78, an IndexError in the panel. Now the second Trainer is refused before it touches anything,
with a line that says which run is in the way and how to stop it.
"""

from __future__ import annotations

import threading

import pytest

from workbench import Session, Trainer
from workbench.train.one_run import RunInProgressError, training_run

from support import REPO
from support.sessions import finish, make_session, make_trainer, running


def test_a_second_trainer_is_refused_while_a_run_trains_and_the_first_goes_on(tmp_path, sessions):
    first = running(tmp_path / "a", sessions)
    with pytest.raises(RunInProgressError) as refused:
        make_trainer(tmp_path / "b")
    message = str(refused.value)
    assert "\n" not in message
    assert str(tmp_path / "a") in message and "Session.running().stop()" in message
    assert f"workbench ctl {tmp_path / 'a'} stop" in message
    assert not (tmp_path / "b").exists()  # refused before anything was written
    with pytest.raises(RunInProgressError):  # a config's run: refused before its model and data load
        Session.from_config(REPO / "examples" / "tiny-gpt.toml",
                            overrides={"training.output_dir": str(tmp_path / "c")})
    assert not (tmp_path / "c").exists()
    assert Session.running() is first
    step = first.snapshot().step
    first.pause(wait=True)  # paused still holds the process: the reset would change it under the run
    with pytest.raises(RunInProgressError):
        make_trainer(tmp_path / "b")
    first.resume()
    from support.waiting import wait_until

    wait_until(lambda: first.snapshot().step > step + 3, "the first run to keep training")
    Session.running().stop(save=False)
    finish(first)
    assert training_run() is None and Session.running() is None
    second = make_session(tmp_path / "b", max_steps=4)
    sessions.append(second)
    finish(second.start())
    assert second.trainer.state.global_step == 4


def test_a_trainer_built_before_cannot_train_while_another_run_trains(tmp_path, sessions):
    idle = make_trainer(tmp_path / "b", max_steps=3)
    first = running(tmp_path / "a", sessions)
    errors: list[BaseException] = []

    def train_idle() -> None:
        try:
            idle.train()
        except BaseException as exc:  # noqa: BLE001 - what the test checks
            errors.append(exc)

    thread = threading.Thread(target=train_idle)
    thread.start()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RunInProgressError), errors
    assert "cannot train" in str(errors[0])
    assert idle.state.global_step == 0 and not (tmp_path / "b").exists()
    assert Session.running() is first
    first.stop(save=False)
    finish(first)
    assert isinstance(idle.train().global_step, int) and idle.state.global_step == 3


def test_a_train_call_that_serves_its_endpoint_claims_once(tmp_path):
    """Trainer.train() with control = true trains through a Session in the same call: the same
    run claims the process twice, which is not a second run."""
    trainer: Trainer = make_trainer(tmp_path / "a", max_steps=3, control=True)
    assert trainer.train().global_step == 3
    assert training_run() is None
