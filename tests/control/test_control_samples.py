"""A run's samples reach every client: an attached RemoteSession and ``workbench watch`` of a
live run read them from the run's events, ``watch`` of an ended run from events.jsonl; all
see the same ``sampled`` events the local Session has."""

from __future__ import annotations

from workbench import SamplesCallback, Session
from workbench.control.client import attach
from workbench.control.watch import ReadOnly, RecordedRun, open_watch
from workbench.door.protocol import SessionLike, Status

from support import DEADLINE, wait_until
from support.lm import lm_trainer
from support.steering import PauseAt

PROMPTS = ["def ", "while "]


def _samples(source: SessionLike) -> list[tuple[int, dict]]:
    return [(e.step, e.data) for e in source.events_since(0)[0] if e.kind == "sampled"]


def test_an_attached_client_and_watch_see_the_samples_live_and_after_the_run(tmp_path, sessions):
    out = tmp_path / "run"
    pause = PauseAt(10)
    trainer = lm_trainer(out, eval_strategy="steps", eval_steps=10, eval_on_start=True,
                         callbacks=[pause, SamplesCallback(prompts=PROMPTS, max_new_tokens=5)])
    session = Session(trainer)
    sessions.append(session)
    pause.session = session
    session.start()
    wait_until(lambda: session.status == Status.PAUSED, "the pause at step 10", DEADLINE)
    local = _samples(session)
    assert [(step, data["prompt"]) for step, data in local] == [(s, p) for s in (0, 10) for p in PROMPTS]
    remote = attach(out)
    assert _samples(remote) == local
    watched = open_watch(out)
    assert isinstance(watched, ReadOnly) and _samples(watched) == local
    watched.close()
    remote.resume()
    assert session.wait(timeout=DEADLINE) == Status.FINISHED
    local = _samples(session)
    assert [step for step, _ in local] == [0, 0, 10, 10, 20, 20, 30, 30, 40, 40]
    wait_until(lambda: _samples(remote) == local, "the remote client to see every sample", DEADLINE)
    remote.close()
    session.close()
    recorded = open_watch(out)  # nothing serves the run any more: its files
    assert isinstance(recorded, RecordedRun) and _samples(recorded) == local
    assert all(data["tokens"] == 5 and data["answer"] for _, data in local)
