"""The control endpoint of a plain ``Trainer.train()`` (``control = true``), and remote
``checkpoints resume_from`` / ``branch`` on live and ended runs, through real sockets."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from workbench import TrainerCallback, TrainingArguments, TrainOutput
from workbench.control.client import attach
from workbench.control.discovery import CONTROL_FILE, NoLiveRun, read_control
from workbench.core.args.training import ArgumentError
from workbench.core.event_file import read_events
from workbench.door.protocol import Status
from workbench.session.local import Session, SessionObserver

from support import Slow, make_session, make_trainer, restarted, wait_until

ENDED = (Status.FINISHED, Status.STOPPED, Status.FAILED)


class ControlFileSeen(TrainerCallback):
    """Records, at every step end, whether the run's control.json exists."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append((Path(args.output_dir) / CONTROL_FILE).exists())


# -- Trainer.train() with control = true ------------------------------------------------------------------


def test_a_plain_trainer_with_control_on_is_steered_remotely(tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(out, callbacks=[Slow()], control=True)
    caller = threading.current_thread()
    threads: list[threading.Thread] = []

    class Where(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not threads:
                threads.append(threading.current_thread())

    trainer.add_callback(Where())
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(output=trainer.train()))
    worker.start()
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() and trainer.state.global_step >= 1, "the endpoint")
        remote = attach(out)
        assert remote.pause(wait=True, timeout=60) == Status.PAUSED
        step = remote.snapshot().step
        assert trainer.state.global_step == step
        applied = remote.set(learning_rate="5e-3", reason="remote check").result(timeout=60)
        assert applied == {"learning_rate": 5e-3}
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3, rel=1e-3)
        path = remote.save().result(timeout=60)
        assert path == out / f"checkpoint-{step}" and (path / "manifest.json").is_file()
        assert remote.resume() == Status.RUNNING
        wait_until(lambda: trainer.state.global_step > step + 3, "the run to go on after resume")
        with pytest.raises(RuntimeError, match="Trainer.train"):  # this call trains its own Trainer only
            remote.branch(path.name, str(tmp_path / "b"))
        remote.resume_from(path.name)  # restarted inside the same train() call
        wait_until(lambda: restarted(remote) and trainer.state.global_step > step + 3, "the restarted run to go on")
        remote.stop(save=False)
        worker.join(60)
    finally:
        if worker.is_alive():
            trainer.stop_request.set("test", save=False)
            worker.join(60)
    output = result["output"]
    assert isinstance(output, TrainOutput) and output.global_step == trainer.state.global_step > step
    assert threads == [worker] and worker is not caller  # trained in the thread that called train()
    edits = [e for e in read_events(out) if e["event"] == "edit"]
    assert edits[-1]["learning_rate"] == 5e-3 and edits[-1]["reason"] == "remote check"
    # The endpoint went with the call, and the Trainer is a plain Trainer again.
    assert not (out / CONTROL_FILE).exists()
    with pytest.raises(NoLiveRun):
        attach(out)
    assert trainer.control_owner is None
    assert not any(isinstance(cb, SessionObserver) for cb in trainer.callback_handler.callbacks)
    assert trainer.gates.steering is None


def test_control_is_off_by_default_for_the_trainer_api(tmp_path):
    seen = ControlFileSeen()
    output = make_trainer(tmp_path / "run", callbacks=[seen], max_steps=4).train()
    assert output.global_step == 4 and seen.seen == [False] * 4
    assert TrainingArguments(str(tmp_path)).control is None
    with pytest.raises(ArgumentError, match="control"):
        TrainingArguments(str(tmp_path), control="yes")
    with pytest.raises(ArgumentError, match="control_port"):
        TrainingArguments(str(tmp_path), control=True, control_port=70000)
    with pytest.raises(ArgumentError, match="control_host.*control_port"):
        TrainingArguments(str(tmp_path), control=True, control_host="0.0.0.0")


def test_control_on_honours_resume_from_checkpoint_and_control_off_wins_in_a_session(tmp_path):
    out = tmp_path / "run"
    make_trainer(out, max_steps=10, save_strategy="steps", save_steps=10).train()
    seen = ControlFileSeen()
    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer = make_trainer(out, callbacks=[seen, Steps()], max_steps=14, control=True)
    output = trainer.train(resume_from_checkpoint=True)
    assert output.global_step == 14 and steps == [11, 12, 13, 14]
    assert all(seen.seen)  # served throughout
    assert not (out / CONTROL_FILE).exists()
    # A Session decides for the Trainer it trains: args.control = false is its default too.
    quiet = make_trainer(tmp_path / "quiet", callbacks=[seen], max_steps=2, control=False)
    seen.seen.clear()
    session = Session(quiet).start()
    assert session.wait(60) == Status.FINISHED and seen.seen == [False, False]


# -- remote resume_from and branch -----------------------------------------------------------------------


def _saved_and_running(out: Path, sessions: list) -> tuple[Session, object, str, int]:
    session = make_session(out, callbacks=[Slow()])
    sessions.append(session.start())
    wait_until(lambda: (out / CONTROL_FILE).exists() and session.snapshot().step >= 2, "the run to start")
    remote = attach(out)
    remote.pause(wait=True, timeout=60)
    path = remote.save()
    path = path.result(timeout=60) if hasattr(path, "result") else path
    step = int(Path(path).name.split("-")[1])
    remote.resume()
    wait_until(lambda: session.snapshot().step > step + 5, "the run to move past its checkpoint")
    return session, remote, Path(path).name, step


def test_remote_resume_from_restarts_a_live_run_and_an_ended_one_keeps_serving(tmp_path, sessions):
    out = tmp_path / "run"
    session, remote, name, step = _saved_and_running(out, sessions)
    socket_before = read_control(out)["socket"]
    # Refused before anything stops: the run goes on.
    with pytest.raises(ValueError, match="checkpoint-999"):
        remote.resume_from("checkpoint-999")
    with pytest.raises(ValueError, match="output_dir"):
        remote.resume_from(name, output_dir=str(tmp_path / "elsewhere"))
    assert session.status not in ENDED
    assert remote.resume_from(name, save_steps=7) is remote
    wait_until(lambda: restarted(remote), "the run to start again from the checkpoint")
    assert session.trainer.args.save_steps == 7
    assert read_control(out)["socket"] == socket_before  # the same endpoint, the same Session
    kinds = [e.kind for e in remote.events_since(0)[0]]
    assert kinds.index("resume_from") > kinds.index("finished")  # stopped, then restarted from the checkpoint
    assert session.stop_reason is None and not list(out.glob("checkpoint-*"))[1:]  # stopped without a save
    # An ended run started with start() keeps serving: read, resume again, then close.
    remote.stop(save=False)
    assert session.wait(60) == Status.STOPPED
    assert (out / CONTROL_FILE).exists() and remote.status == Status.STOPPED
    remote.resume_from(name)
    wait_until(lambda: session.status == Status.RUNNING, "the ended run to restart")
    session.stop(save=False)
    session.wait(60)
    session.close()
    assert not (out / CONTROL_FILE).exists()
    with pytest.raises(NoLiveRun):
        attach(out)


def test_remote_branch_starts_a_new_served_run_from_a_live_one(tmp_path, sessions):
    out = tmp_path / "run"
    session, remote, name, step = _saved_and_running(out, sessions)
    with pytest.raises(ValueError, match="own output_dir"):
        remote.branch(name, str(out))
    with pytest.raises(ValueError, match="learning_rate"):
        remote.branch(name, str(tmp_path / "b"), learning_rate=-1.0)
    assert session.status not in ENDED
    child = remote.branch(name, str(tmp_path / "b"), learning_rate=2e-3)
    assert session.wait(60) == Status.STOPPED
    saved = sorted(p.name for p in out.glob("checkpoint-*"))
    assert len(saved) == 2 and name in saved  # the parent stopped with a checkpoint (save defaults to true)
    branch = session.successor
    assert branch is not None and branch.origin["checkpoint"] == str((out / name).resolve())
    assert child.snapshot().output_dir == str(tmp_path / "b")
    assert read_control(tmp_path / "b")["socket"] != read_control(out)["socket"]  # each run its own endpoint
    wait_until(lambda: branch.snapshot().step > step, "the branch to train")
    assert branch.trainer.optimizer.param_groups[0]["lr"] <= 2e-3
    assert [e["event"] for e in read_events(tmp_path / "b")][0] == "branch"
    child.stop(save=False)
    assert branch.wait(60) == Status.STOPPED
    assert remote.status == Status.STOPPED  # the parent's endpoint still answers


# -- the command line: a headless run restarted and branched by `workbench ctl` ---------------------------


def test_an_ended_session_serves_until_dropped_and_then_frees_its_model(tmp_path):
    import gc
    import weakref

    out = tmp_path / "run"
    session = make_session(out, max_steps=3)
    assert session.start().wait(60) == Status.FINISHED
    assert attach(out).status == Status.FINISHED  # still served after the run ended
    model = weakref.ref(session.model)
    del session
    gc.collect()
    wait_until(lambda: not (out / CONTROL_FILE).exists(), "the endpoint of a dropped Session to close")
    assert model() is None  # the endpoint kept neither the Session nor its model alive
