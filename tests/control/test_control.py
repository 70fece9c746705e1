"""Remote control (workbench.control): the protocol, the server's defences, a RemoteSession
steering a real run exactly as a local Session does, TCP tokens, stale control files, and
``workbench ctl`` / ``watch`` against real headless ``workbench run`` subprocesses."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.control.client import Connection, attach
from workbench.control.discovery import CONTROL_FILE, NoLiveRun, read_control, write_control
from workbench.control.protocol import (
    MAX_LINE,
    ProtocolError,
    decode_request,
    downsample,
    encode,
    snapshot_from_dict,
    snapshot_to_dict,
)
from workbench.core.event_file import read_events
from workbench.door.protocol import SessionLike, Status

from support import REPO, Slow, make_session, running, wait_until

# -- protocol ----------------------------------------------------------------------------------------


def test_protocol_messages_and_limits():
    assert decode_request(b'{"id": 3, "cmd": "pause", "args": {"wait": true}}') == (3, "pause", {"wait": True})
    for bad, why in ((b"nonsense", "not a JSON line"), (b"[1]", "JSON object"), (b'{"id": "x", "cmd": "a"}', "id"),
                     (b'{"id": 1, "cmd": ""}', "cmd"), (b'{"id": 1, "cmd": "a", "args": 3}', "args")):
        with pytest.raises(ProtocolError, match=why):
            decode_request(bad)
    with pytest.raises(ProtocolError, match="limit"):
        encode({"blob": "x" * MAX_LINE})
    with pytest.raises(ProtocolError, match="limit"):
        decode_request(b" " * (MAX_LINE + 1))
    points = [(i, float(i)) for i in range(1000)]
    thin = downsample(points, 10)
    assert len(thin) == 10 and thin[0] == (0, 0.0) and thin[-1] == (999, 999.0)
    assert downsample(points[:5], 10) == points[:5]


def test_snapshot_survives_the_wire(tmp_path, sessions):
    session = running(tmp_path / "run", sessions)
    session.pause(wait=True, timeout=60)
    session.save()
    snap = session.snapshot()
    back = snapshot_from_dict(json.loads(encode(snapshot_to_dict(snap))))
    assert back == snap  # statuses, series, memory, checkpoint rows and edits all round-trip


# -- a RemoteSession does what a local Session does ----------------------------------------------------


def test_remote_session_steers_like_a_local_one(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    info = read_control(out)
    assert stat.S_IMODE((out / CONTROL_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(info["socket"]).parent.stat().st_mode) == 0o700
    assert info["pid"] == os.getpid() and info["protocol"] == 1 and "token" not in info
    remote = attach(out)
    assert isinstance(remote, SessionLike)
    assert remote.pause(wait=True, timeout=60) == Status.PAUSED == session.status
    step = session.snapshot().step
    # The same refusal, word for word, from the run's one rule.
    with pytest.raises(ValueError) as local_error:
        session.set(learning_rate=-1)
    with pytest.raises(ValueError) as remote_error:
        remote.set(learning_rate=-1)
    assert str(remote_error.value) == str(local_error.value)
    applied = remote.set(learning_rate="5e-3").result(timeout=60)
    assert applied == {"learning_rate": 5e-3}
    assert session.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3, rel=1e-3)
    edits = [e for e in read_events(out) if e["event"] == "edit"]
    assert edits and edits[-1]["learning_rate"] == 5e-3 and edits[-1]["step"] == step
    path = remote.save().result(timeout=60)
    assert path == out / f"checkpoint-{step}" and (path / "manifest.json").is_file()
    assert [r.name for r in remote.checkpoints] == [r.name for r in session.checkpoints] == [path.name]
    metrics = remote.evaluate().result(timeout=60)
    assert "eval_loss" in metrics
    assert remote.snapshot().step == step and remote.snapshot().edits[-1]["learning_rate"] == 5e-3
    assert remote.resume() == Status.RUNNING
    wait_until(lambda: session.snapshot().step > step + 3, "the run to go on after a remote resume")
    # Queued while running: the save lands at the next step end and the Future gets its path.
    queued = remote.save().result(timeout=60)
    assert (queued / "manifest.json").is_file()
    kinds = [e.kind for e in remote.events_since(0)[0]]
    assert {"paused", "edited", "saved", "evaluated", "resumed"} <= set(kinds)
    assert remote.stop(save=False) in (Status.STOPPING, Status.STOPPED)
    assert session.wait(60) == Status.STOPPED
    # A Session started with start() serves its ended run until close(); the client says it has ended.
    assert remote.status == Status.STOPPED and attach(out).status == Status.STOPPED
    session.close()
    assert not (out / CONTROL_FILE).exists() and not Path(info["socket"]).exists()
    with pytest.raises(NoLiveRun, match="no live run"):
        attach(out)


def test_every_client_sees_the_others_commands(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    watcher, actor = attach(out), attach(out)
    cursor = watcher.events_since(0)[1]
    stream = watcher.events(cursor=cursor, timeout=30)
    actor.pause(wait=True, timeout=60)
    actor.set(logging_steps="7").result(timeout=60)
    actor.resume()
    seen = []
    for event in stream:
        seen.append(event.kind)
        if event.kind == "resumed":
            break
    assert seen[:3] == ["paused", "edited", "resumed"]
    session.stop(save=False)


# -- hostile clients: tests/test_control_hostile.py -------------------------------------------------------


# -- TCP and stale files -------------------------------------------------------------------------------------


def test_a_stale_control_file_is_reported_and_replaced(tmp_path, sessions):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_control(out, {"protocol": 1, "pid": dead.pid, "host": socket.gethostname(), "started": 0,
                        "socket": str(tmp_path / "gone.sock")})
    with pytest.raises(NoLiveRun, match="stale"):
        attach(out)
    ctl = subprocess.run([sys.executable, "-m", "workbench", "ctl", str(out), "status"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ctl.returncode == 3 and "stale" in ctl.stderr
    session = running(out, sessions)
    assert read_control(out)["pid"] == os.getpid()
    assert attach(out).status == session.status


# -- watch ------------------------------------------------------------------------------------------------


def test_watch_rebuilds_an_ended_run_from_its_files(tmp_path, sessions):
    from workbench.control.watch import RecordedRun, open_watch

    out = tmp_path / "run"
    session = make_session(out, max_steps=30, logging_steps=5, save_strategy="steps", save_steps=10,
                           eval_strategy="steps", eval_steps=10)
    sessions.append(session.start())
    assert session.wait(120) == Status.FINISHED
    session_edits = len(session.snapshot().edits)
    assert not isinstance(open_watch(out), RecordedRun)  # the ended run still serves: watched live
    session.close()
    watched = open_watch(out)  # nothing answers any more: the recording
    assert isinstance(watched, RecordedRun) and isinstance(watched, SessionLike)
    snap = watched.snapshot()
    assert snap.status == Status.FINISHED and snap.step == 30 and snap.max_steps == 30
    assert [s for s, _ in snap.series["loss"]] == [5, 10, 15, 20, 25, 30]
    assert snap.series["loss"] == session.snapshot().series["loss"]
    assert [s for s, _ in snap.series["eval_loss"]] == [10, 20, 30]
    assert [r.name for r in watched.checkpoints] == [r.name for r in session.checkpoints]
    assert len(snap.edits) == session_edits
    events, cursor = watched.events_since(0)
    assert events[0].kind == "started" and events[-1].kind == "finished" and cursor == len(events)
    with pytest.raises(RuntimeError, match="has ended"):
        watched.pause()
    with pytest.raises(RuntimeError, match="has ended"):
        watched.set(learning_rate=1e-3)


# -- the command line against a real headless run -------------------------------------------------------------


# -- the dashboard on a remote run ---------------------------------------------------------------------------


def test_attached_dashboard_q_enter_detaches_and_the_run_goes_on(tmp_path, sessions):
    import asyncio

    from workbench.widgets.tui import DashboardApp
    from workbench.widgets.tui.dialogs import QuitDialog

    out = tmp_path / "run"
    session = running(out, sessions)
    remote = attach(out)
    app = DashboardApp(remote, attached=True)

    async def until(pilot, condition, what):
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await pilot.pause(0.05)

    async def main() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            await until(pilot, lambda: app._snapshot is not None and app._snapshot.step >= 1, "the remote snapshot")
            app.simulate_key("q")
            await until(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the quit dialog")
            assert app.screen.focused.id == "quit-detach"
            app.simulate_key("enter")
            await until(pilot, lambda: app.return_value is not None, "the app to exit")

    asyncio.run(main())
    assert app.return_value == "detached"
    step = session.snapshot().step
    assert session.status not in (Status.STOPPING, Status.STOPPED)
    wait_until(lambda: session.snapshot().step > step + 3, "the run to go on after the dashboard detached")


def test_the_agent_example_halves_the_lr_on_a_plateau(tmp_path, sessions):
    sys.path.insert(0, str(REPO / "examples"))
    from agent_lr_policy import watch_and_steer

    out = tmp_path / "run"
    # learning_rate 0: the eval loss never improves, so every `patience` evaluations is a plateau.
    session = make_session(out, callbacks=[Slow()], max_steps=60, learning_rate=0.0, eval_strategy="steps",
                           eval_steps=4)
    sessions.append(session.start())
    wait_until(lambda: (out / CONTROL_FILE).exists(), "control.json")
    decisions = watch_and_steer(str(out), patience=2, max_cuts=2)
    assert session.wait(120) == Status.FINISHED
    assert [d["applied"] for d in decisions] == [{"lr_scale": 0.5}, {"lr_scale": 0.5}]
    assert all("has not improved" in d["reason"] for d in decisions)
    edits = [e for e in read_events(out) if e["event"] == "edit"]
    assert [e["lr_scale"] for e in edits] == [0.5, 0.5]
    # Each decision is recorded with its reason, in the event and in the live-edit record.
    assert [e["reason"] for e in edits] == [d["reason"] for d in decisions]
    assert [e.get("reason") for e in session.trainer.workbench_state.live_edits] == [d["reason"] for d in decisions]


def test_an_edit_keeps_its_reason_locally_remotely_and_across_ranks_records(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    remote = attach(out)
    remote.pause(wait=True, timeout=60)
    with pytest.raises(ValueError, match="reason: expected text"):
        remote.set(learning_rate=1e-3, reason=5)
    with pytest.raises(ValueError, match="reason: expected text"):
        session.set(learning_rate=1e-3, reason=["x"])
    with pytest.raises(ValueError, match="character limit"):
        remote.set(learning_rate=1e-3, reason="x" * 2000)
    assert not session.trainer.workbench_state.live_edits, "a refused reason changed the run"
    assert remote.set(learning_rate=1e-3, reason=" eval loss flat\n for 3 evals ").result(timeout=60) == {
        "learning_rate": 1e-3}
    session.set(max_steps=500)  # no reason: no reason key
    first, second = session.trainer.workbench_state.live_edits
    assert first["reason"] == "eval loss flat for 3 evals" and "reason" not in second
    edits = [e for e in read_events(out) if e["event"] == "edit"]
    assert edits[0]["reason"] == "eval loss flat for 3 evals" and "reason" not in edits[1]
    assert [e.kind for e in session.events_since(0)[0]].count("edited") == 2
    # The rank agreement carries records with reasons; only the edits are applied.
    from workbench.core.edits import edit_changes

    assert edit_changes(first) == {"learning_rate": 1e-3}
    remote.close()


def test_a_socket_another_user_owns_is_not_connected_to(tmp_path, sessions, monkeypatch):
    out = tmp_path / "run"
    running(out, sessions)
    real = os.getuid()
    with monkeypatch.context() as patch:
        patch.setattr(os, "getuid", lambda: real + 1)  # as if the socket were someone else's
        with pytest.raises(PermissionError, match="owned by uid"):
            attach(out)
    attach(out).close()


def test_a_subscriber_hears_an_event_at_once_not_at_the_next_poll(tmp_path, sessions, monkeypatch):
    import workbench.control.server as server

    monkeypatch.setattr(server, "POLL_S", 5.0)  # a poll this slow would hold the event back for seconds
    out = tmp_path / "run"
    session = running(out, sessions)
    session.pause(wait=True, timeout=60)
    conn = Connection(read_control(out))
    conn.call("events", cursor=session.events_since(0)[1], subscribe=True)  # subscribed from now on
    sent = time.monotonic()
    session.resume()
    kinds: list[str] = []
    while "resumed" not in kinds:
        kinds.append(json.loads(conn._line(10.0))["event"]["kind"])
    assert "resumed" in kinds and time.monotonic() - sent < 2.0
    conn.close()


# -- how a run ended, and a restarted run --------------------------------------------------------------------


def test_a_client_hears_how_the_run_ended_and_follows_its_restart(tmp_path, sessions):
    """The last event carries the stop reason and exit code; once the endpoint is gone the
    client says so from events.jsonl; a --resume restart in the same output_dir (new
    endpoint, new run) is followed, with cursors that keep counting."""
    out = tmp_path / "run"
    first = running(out, sessions, max_steps=100_000, save_strategy="no")
    remote = attach(out)
    started = remote.info["started"]
    first.stop(save=True)
    assert first.wait(60) == Status.STOPPED
    first.close()  # a start()ed Session serves its ended run until closed
    wait_until(lambda: not (out / CONTROL_FILE).exists(), "the endpoint to close")
    step = first.snapshot().step
    last = first.events_since(0)[0][-1]  # what a client still connected hears last
    assert last.kind == "finished" and last.data["stopped"]
    assert (last.data["stop_reason"], last.data["saved"], last.data["exit_code"]) == ("session", True, 0)
    events, cursor = remote.events_since(0)  # this one comes late: events.jsonl tells it
    assert [e.kind for e in events] == ["gone"] and events[0].step == step
    assert (events[0].data["stop_reason"], events[0].data["exit_code"]) == ("session", 0)
    assert remote.events_since(cursor) == ([], cursor)  # said once
    assert remote.status == Status.STOPPED and remote.stop_reason == "session"
    # In the words every front-end uses (door/endings.py): who stopped it, not "session".
    assert remote.end_note() == f"the run stopped from Python (session.stop()) at step {step}, checkpoint saved " \
                                "(exit code 0)"

    from workbench import Session

    trainer = make_session(out, max_steps=step + 4000, save_strategy="no", callbacks=[Slow()]).trainer
    second = Session(trainer, resume_from_checkpoint=True)  # the newest checkpoint: the one the stop saved
    sessions.append(second.start())
    wait_until(lambda: (out / CONTROL_FILE).exists() and second.snapshot().step > step, "the restarted run")
    snap = remote.snapshot()
    assert remote.info["started"] == read_control(out)["started"] != started  # the new endpoint
    assert snap.status in (Status.RUNNING, Status.SAVING, Status.EVALUATING) and snap.step > step
    more, later = remote.events_since(cursor)
    assert more[0].kind == "followed" and "following it" in more[0].data["note"]
    assert more[1].kind == "started" and more[1].step == step  # the new run from its first event
    assert later == cursor + len(more) - 1  # cursors count on ("followed" is the client's own)
    assert remote.pause(wait=True, timeout=60) == Status.PAUSED  # steering reaches the new run
    assert second.status == Status.PAUSED
    second.stop(save=False)
    second.wait(60)


def test_a_run_gone_without_an_end_is_reported_as_killed(tmp_path):
    from workbench.control.outcome import end_note, last_outcome
    from workbench.core.event_file import EventFile

    log = EventFile(tmp_path)
    log.write("start", 0, max_steps=10, pid=41)
    log.write("end", 10, status="finished", stop_reason=None, saved=True, exit_code=0, pid=41)
    assert last_outcome(tmp_path)["exit_code"] == 0
    assert end_note(tmp_path, 41) == "the run finished at step 10 (exit code 0)"
    # pid 42 was killed before its first record: its predecessor's end is not its own
    assert end_note(tmp_path, 42).startswith("the run (pid 42) is gone without recording how it ended")
    log.write("start", 10, max_steps=20, pid=43)  # resumed, then SIGKILLed: no end after this start
    log.write("log", 12, loss=1.0)
    assert last_outcome(tmp_path) is None and last_outcome(tmp_path, 43) is None
    assert end_note(tmp_path, 43).startswith("the run (pid 43) is gone without recording how it ended")
    log.write("error", 12, error="ValueError: bad batch", exit_code=1, pid=43)
    assert end_note(tmp_path, 43) == end_note(tmp_path) == "the run failed at step 12 (exit code 1)"


def test_attached_dashboard_resumes_a_headless_run_from_a_checkpoint_in_its_process(tmp_path):
    """The dashboard's resume-from on a run trained in its caller's thread (as `workbench run
    --headless` does): the run restarts there; the dashboard must not stop it first, which
    would end the process it asks to restart."""
    import asyncio
    import threading

    from workbench.widgets.tui import DashboardApp

    out = tmp_path / "run"
    session = make_session(out, callbacks=[Slow()], save_strategy="steps", save_steps=5)
    session.control = True
    ran: list = []
    worker = threading.Thread(target=lambda: ran.append(session.run()), daemon=True)
    worker.start()
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() and session.snapshot().step > 7, "a checkpoint and more steps")
        remote = attach(out)
        row = next(r for r in remote.checkpoints if r.name == "checkpoint-5")
        app = DashboardApp(remote, attached=True)

        async def main() -> None:
            async with app.run_test(size=(100, 32)) as pilot:
                app.resume_from(row)
                deadline = time.monotonic() + 60
                while "resume_from" not in [e.kind for e in session.events_since(0)[0]]:
                    assert time.monotonic() < deadline, "timed out waiting for the restart"
                    await pilot.pause(0.05)

        asyncio.run(main())

        def restarted() -> bool:
            kinds = [e.kind for e in session.events_since(0)[0]]
            return "started" in kinds[kinds.index("resume_from"):] and session.snapshot().step > 6

        wait_until(restarted, "the restarted run to train")
        assert session.status == Status.RUNNING
        assert worker.is_alive() and (out / CONTROL_FILE).exists()  # same thread, same endpoint
        starts = [e for e in read_events(out) if e["event"] == "start"]
        assert [s["step"] for s in starts] == [0, 5]
    finally:
        session.stop(save=False)
        worker.join(60)
    assert ran == [Status.STOPPED]
