"""A run's history never outgrows a reply, and a look inside never stalls it (issue 24): 1,000
live edits with long reasons against every reply and ``workbench watch`` in a real terminal,
sampling capped, checked and kept out of the training loop's way, and a dashboard that goes
on through replies it cannot use. Real runs, real sockets (tests/test_control_hostile.py has
the hostile clients)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from workbench.control.client import Connection, attach
from workbench.control.discovery import CONTROL_FILE, read_control, write_control
from workbench.control.protocol import MAX_LINE, encode
from workbench.control.replies import FIELDS_BUDGET, MAX_EVENT_BYTES, PAGE_BYTES, ReplyCache
from workbench.door.protocol import Status
from workbench.door.values import SNAPSHOT_EDITS, CheckpointRow, SessionEvent, Snapshot

from support import Slow, raw, running, wait_until, workbench

# -- a history bigger than a line ------------------------------------------------------------------------------


def test_replies_stay_bounded_with_a_thousand_long_edits(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    session.pause(wait=True, timeout=60)
    why = "the eval loss has not improved for three evaluations, " * 9  # ~500 characters
    why = why[:500]
    for i in range(1000):
        session.set(lr_scale=1.0, reason=f"{i}: {why}"[:500])
    for _ in range(3):  # three checkpoints at three steps, each carrying the 1,000 edits
        session.save()
        step = session.snapshot().step
        session.resume()
        wait_until(lambda: session.snapshot().step > step, "a step")
        session.pause(wait=True, timeout=60)
    with pytest.raises(ValueError, match="500-character limit"):
        session.set(lr_scale=1.0, reason="x" * 501)
    conn = Connection(read_control(out))
    sock = raw(read_control(out))
    for request in ({"cmd": "snapshot"}, {"cmd": "events", "args": {"cursor": 0}},
                    {"cmd": "checkpoints", "args": {"action": "list"}}):
        sock.sendall(encode({"id": 1, **request}))
        data = b""
        while not data.endswith(b"\n"):
            data += sock.recv(1 << 20)
        reply = json.loads(data)
        assert reply["ok"], (request, reply.get("error"))
        assert len(data) < MAX_LINE and (request["cmd"] == "snapshot" or len(data) < PAGE_BYTES + 70_000)
    sock.close()
    with pytest.raises(ValueError, match="500-character limit"):
        conn.call("set", changes={"lr_scale": 1.0}, reason="x" * 501)
    conn.close()
    remote = attach(out)
    snap = remote.snapshot()
    assert len(snap.edits) == SNAPSHOT_EDITS and snap.edit_count == 1000 == session.snapshot().edit_count
    assert snap.edits[-1] == session.snapshot().edits[-1]
    rows = remote.checkpoints
    assert [r.name for r in rows] == [r.name for r in session.checkpoints] and len(rows) == 3
    assert all(len(r.edits) == 5 for r in rows) and [r.edit_count for r in rows] == [1000, 1000, 1000]
    assert rows[-1].edits[-1]["reason"].startswith("999: ")
    events, cursor = remote.events_since(0)  # page after page
    local, total = session.events_since(0)
    assert cursor == total and [e.kind for e in events] == [e.kind for e in local] and len(events) > 1000
    listed = workbench("ctl", out, "checkpoints", cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.count("checkpoint-") == 3, listed.stderr
    too_long = workbench("ctl", out, "set", "lr_scale=1.0", "--reason", "y" * 600, cwd=tmp_path)
    assert too_long.returncode == 2 and "500-character limit" in too_long.stderr
    assert too_long.stderr.count("\n") == 1
    remote.close()


def test_a_snapshot_of_any_history_fits_its_budget():
    """Rows by the hundred with long edits, a failed run's huge traceback, an event with a
    megabyte of error text: the encoded pieces stay bounded, the counts and newest stay exact."""
    edit = {"step": 1, "time": 1.0, "lr_scale": 0.5, "reason": "r" * 500}
    rows = tuple(CheckpointRow(name=f"checkpoint-{i}", path=f"/x/checkpoint-{i}", step=i, complete=True, best=i == 3,
                               edits=[edit] * 5, edit_count=1000, metrics={f"eval_m{j}": 1.0 for j in range(30)})
                 for i in range(300))
    snap = Snapshot(step=300, checkpoints=rows, edits=(edit,) * SNAPSHOT_EDITS, edit_count=5000,
                    error="BoomError: " + "x" * 1_000_000, traceback="Traceback\n" + "  frame\n" * 200_000)
    cache = ReplyCache()
    data = cache.fields(snap)
    assert len(data) <= FIELDS_BUDGET
    fields = json.loads(data)
    names = [r["name"] for r in fields["checkpoints"]]
    assert names[-1] == "checkpoint-299" and "checkpoint-3" in names  # the newest, and the best
    assert fields["edit_count"] == 5000 and fields["traceback"].endswith("  frame\n")
    assert len(fields["error"]) < 30_000
    event = SessionEvent("failed", 300, 1.0, {"error": "BoomError: " + "x" * 1_000_000, "exit_code": 1})
    encoded = cache.event(event)
    assert len(encoded) <= MAX_EVENT_BYTES and json.loads(encoded)["data"]["cut"] is True
    assert json.loads(encoded)["data"]["exit_code"] == 1


# -- sampling ------------------------------------------------------------------------------------------------------


def _gpt_session(out: Path):
    import torch

    from workbench import Session, Trainer, TrainingArguments
    from workbench.data.builtin import builtin_tokenizer, load_builtin_data
    from workbench.models import TinyGPT

    train, _ = load_builtin_data("python-source", block_size=32, max_chars=20_000)
    tok = builtin_tokenizer("python-source")
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    args = TrainingArguments(str(out), max_steps=100_000, per_device_train_batch_size=8, learning_rate=3e-3,
                             logging_steps=5, save_strategy="no", report_to="none", disable_tqdm=True, seed=1)
    return Session(Trainer(model=model, args=args, train_dataset=train, processing_class=tok, callbacks=[Slow()]))


BAD_SAMPLES = [({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 20_000}, "1 to 1024"),
               ({"max_new_tokens": "10"}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
               ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
               ({"temperature": float("nan")}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_k": 2.5}, "top_k"),
               ({"seed": -1}, "seed"), ({"prompt": ""}, "prompt")]


def test_sample_is_capped_checked_and_never_runs_while_the_loop_trains(tmp_path, sessions):
    out = tmp_path / "run"
    session = _gpt_session(out)
    sessions.append(session.start())
    wait_until(lambda: (out / CONTROL_FILE).exists() and session.snapshot().step >= 2, "the run to start")
    remote = attach(out)
    person = attach(out, client="attach")  # an attached dashboard's inspect screen
    for where in (session, remote, person):
        with pytest.raises(RuntimeError, match="pause it first") as refused:
            where.sample("def ", max_new_tokens=8)
        assert "\n" not in str(refused.value)
        # Worded for the caller: Python (in process, or a script over workbench.attach) is told
        # the Python call; a person at a dashboard or command line the key and the CLI command.
        told = str(refused.value)
        assert ("session.pause(wait=True)" in told) == (where is not person), told
        assert (f"p in the dashboard, or workbench ctl {out} pause --wait" in told) == (where is person), told
        for options, word in BAD_SAMPLES:
            with pytest.raises(ValueError, match=word) as bad:
                where.sample(**{"prompt": "def ", **options})
            assert str(bad.value).startswith("sample") and "\n" not in str(bad.value)
    # inspect() while training never waits for the loop's lock (here held by another thread): a live reading.
    held, release, reports = threading.Event(), threading.Event(), []

    def hold() -> None:
        with session._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10)
    reader = threading.Thread(target=lambda: reports.append(session.inspect()), daemon=True)
    reader.start()
    reader.join(20)
    release.set()
    holder.join(10)
    assert reports and reports[0]["layers"] and reports[0]["can_sample"] is True
    assert session.pause(wait=True, timeout=60) == Status.PAUSED
    step = session.snapshot().step
    text = remote.sample("def ", max_new_tokens=1024)  # the cap itself is allowed
    assert isinstance(text, str) and text
    assert remote.sample("def ", max_new_tokens=16, seed=3) == session.sample("def ", max_new_tokens=16, seed=3)
    assert session.snapshot().step == step and session.model.training
    remote.close()
    person.close()


# -- watching a run whose replies fail -------------------------------------------------------------------------------


class HostileServer:
    """A real Unix socket that speaks the protocol's hello, then answers every snapshot and
    events request with an error or a broken line: what a dashboard must survive."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.asked = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        for line in reader:
            request = json.loads(line)
            cmd, ident = request["cmd"], request["id"]
            self.asked += 1
            if cmd == "hello":
                reply = {"id": ident, "ok": True, "result": {"protocol": 1, "run_name": "hostile"}}
            elif cmd == "status":
                reply = {"id": ident, "ok": True, "result": {"status": "running", "stop_reason": None}}
            elif self.asked % 2:
                reply = {"id": ident, "ok": False, "error": "snapshot of 2000000 bytes is over the limit",
                         "kind": "ProtocolError"}
            else:
                conn.sendall(b"{broken\n")
                continue
            conn.sendall(encode(reply))

    def close(self) -> None:
        self.listener.close()


def test_watch_survives_replies_it_cannot_use(tmp_path):
    import asyncio

    from workbench.control.watch import ReadOnly, open_watch
    from workbench.widgets.tui import DashboardApp

    out = tmp_path / "run"
    out.mkdir()
    sock = tmp_path / "h.sock"
    server = HostileServer(sock)
    write_control(out, {"protocol": 1, "pid": os.getpid(), "host": socket.gethostname(), "started": 1.0,
                        "socket": str(sock), "output_dir": str(out)})
    watched = open_watch(out)
    assert isinstance(watched, ReadOnly)
    app = DashboardApp(watched, attached=True)

    async def main() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            deadline = time.monotonic() + 60
            while server.asked < 12 or app._poll_error is None:
                assert time.monotonic() < deadline, "the dashboard did not poll"
                await pilot.pause(0.1)
            assert app.is_running and "could not be shown" in app._poll_error
            app.exit("detached")

    try:
        asyncio.run(main())
    finally:
        watched.close()
        server.close()
    assert app.return_value == "detached"
