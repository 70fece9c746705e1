"""Real Sessions to steer: the small MLP on random classes, running until stopped, and the
cleanup every test that starts one needs (the ``sessions`` fixture in conftest.py)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import torch

from workbench import Session, Trainer, TrainerCallback, TrainingArguments
from workbench.control.discovery import CONTROL_FILE
from workbench.data.builtin import load_builtin_data
from workbench.door.protocol import ENDED, Status
from workbench.models import MLPClassifier

from support.waiting import DEADLINE, wait_until


class Slow(TrainerCallback):
    """``seconds`` per step, so a run meant to be steered or watched does not race to its end."""

    def __init__(self, seconds: float = 0.003) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def make_trainer(out: Path, callbacks=(), compute_metrics=None, dropout: float = 0.0, guard: Any = None,
                 **kwargs: Any) -> Trainer:
    """The tiny real Trainer the Session tests steer (an MLP on random classes; runs until
    stopped); ``dropout`` > 0 makes each step draw from the random streams; ``guard``: a Guard."""
    train, evals = load_builtin_data("random-classification", n_train=256, n_eval=32, in_features=8,
                                     num_classes=3, seed=1)
    settings = dict(max_steps=100_000, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                    learning_rate=1e-2, logging_steps=5, save_strategy="no", disable_tqdm=True,
                    report_to="none", seed=0)
    settings.update(kwargs)
    torch.manual_seed(0)
    return Trainer(model=MLPClassifier(in_features=8, hidden=16, num_classes=3, dropout=dropout),
                   args=TrainingArguments(str(out), **settings), train_dataset=train, eval_dataset=evals,
                   compute_metrics=compute_metrics, callbacks=list(callbacks), guard=guard)


def make_session(out: Path, callbacks=(), compute_metrics=None, **kwargs: Any) -> Session:
    """A Session over :func:`make_trainer`'s run, not started."""
    return Session(make_trainer(out, callbacks, compute_metrics, **kwargs))


def finish(session: Any, timeout: float = DEADLINE) -> Status:
    """``session.wait()`` with a deadline: fails (instead of hanging) when the run does not end."""
    status = session.wait(timeout)
    assert status in ENDED, f"the run did not end within {timeout}s (status {status})"
    return status


def finished_run(out: Path, sessions: list, **kwargs: Any) -> Session:
    """A :func:`make_session` run of ``kwargs`` (max_steps, ...) started and waited to its end."""
    session = make_session(out, **kwargs)
    sessions.append(session)
    assert session.start().wait(timeout=DEADLINE) == Status.FINISHED
    return session


def running(out: Path, sessions: list, **kwargs: Any) -> Session:
    """A slowed :func:`make_session` run, started, serving its endpoint and past step 1."""
    session = make_session(out, callbacks=[Slow()], **kwargs)
    sessions.append(session.start())
    wait_until(lambda: (out / CONTROL_FILE).exists() and session.snapshot().step >= 1, "the run to start")
    return session


def stop_all(made: list) -> None:
    """Stop every Session in ``made`` (and the branches they handed over to) without saving,
    wait for it and close its endpoint: no stray training threads outlive a test."""
    while made:
        s = made.pop(0)
        if getattr(s, "successor", None) is not None:
            made.append(s.successor)
        s.stop(save=False)  # nothing for an ended or never-started run; lifts a pause too
        try:
            s.wait(DEADLINE)
        except BaseException:  # noqa: BLE001 - cleanup only: the test's own assertions are what matter
            pass
        s.close()


def raw(info: dict) -> socket.socket:
    """A bare connection to the control socket ``info`` (a control.json) names."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(info["socket"])
    return sock


def read_lines(sock: socket.socket) -> list[dict]:
    """Every line the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def restarted(remote) -> bool:
    """Whether the run the client is attached to has started again after a resume_from."""
    kinds = [e.kind for e in remote.events_since(0)[0]]
    return "resume_from" in kinds and kinds[kinds.index("resume_from"):][:2] == ["resume_from", "started"]
