"""No client can hurt a run (issue 24): the control endpoint against hostile, greedy and broken
clients, on real sockets, with real runs in this process and in ``workbench run`` subprocesses.

Malformed lines and every argument of every command gone wrong (an error reply, nothing done,
nothing on the run's stderr), floods (delayed, never answered early, the server within its
CPU budget), idle and unauthenticated connections (deadlines; the owner always gets a slot,
or one clear line). A history bigger than a line and sampling: tests/test_control_history.py."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from workbench import TrainerCallback
from workbench.control import reactor
from workbench.control import requests as schema_module
from workbench.control.client import Connection, Refused, attach
from workbench.control.discovery import CONTROL_FILE, read_control
from workbench.control.protocol import MAX_LINE, encode
from workbench.control.requests import CHECKPOINT_ACTIONS, SCHEMAS, check_request
from workbench.core.event_file import read_events
from workbench.door.protocol import Status

from support import Slow, make_session, raw, read_lines, running, wait_until, workbench


def replies_until_closed(sock: socket.socket, limit: float = 30.0) -> list[dict]:
    """Every line the server sends until it closes the connection (or ``limit`` seconds)."""
    sock.settimeout(limit)
    return read_lines(sock)


def one_reply(sock: socket.socket) -> dict:
    """The next line the server sends on ``sock``."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection without a reply"
        data += chunk
    return json.loads(data.splitlines()[0])


# -- malformed lines ---------------------------------------------------------------------------------

MALFORMED = [
    b"this is not json", b'{"id": 1}', b"[1, 2]", b"NaN", b'"a string"', b"\x00" * 64, b"\xff\xfe\xfd not utf-8",
    b"[" * 5000 + b"]" * 5000,  # nested too deeply for a recursive parser
    b'{"id": 1, "cmd": "status", "args": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
    b'{"id": 1e400, "cmd": "status"}', b'{"id": true, "cmd": "status"}', b'{"id": 1, "cmd": ["status"]}',
    b'{"id": 1, "cmd": "status", "args": []}', b'{"id": ' + b"9" * 5000 + b', "cmd": "status"}',
]
# Well-formed lines with arguments of the wrong kind: an error reply, and the connection stays.
WRONG = [
    {"cmd": "parse_overrides", "args": {"text": 5}}, {"cmd": "parse_overrides", "args": {"text": ["a=1"]}},
    {"cmd": "parse_overrides", "args": {"text": {"learning_rate": 1}}}, {"cmd": "parse_overrides", "args": {}},
    {"cmd": "set", "args": {"changes": {"reason": "x"}}}, {"cmd": "set", "args": {"changes": {"self": 1}}},
    {"cmd": "check_branch", "args": {"checkpoint": [], "output_dir": {}}},
    {"cmd": "sample", "args": {"prompt": "x", "max_new_tokens": "many"}},
    {"cmd": "events", "args": {"cursor": -5}}, {"cmd": "events", "args": {"cursor": 10**12}},
    {"cmd": "series", "args": {"points": 10**12}}, {"cmd": "series", "args": {"names": "loss"}},
    {"cmd": "checkpoints", "args": {"action": ["list"]}}, {"cmd": "launch_missiles"},
    {"cmd": "snapshot", "args": {"since": "yesterday"}}, {"cmd": "set", "args": {"changes": {"learning_rate": 1e-3},
                                                                              "reason": {"why": "x" * 1000}}},
]


def test_bad_messages_get_an_error_and_the_connection_closes(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    info = read_control(out)
    for payload in MALFORMED:
        sock = raw(info)
        sock.sendall(payload + b"\n")
        replies = replies_until_closed(sock)  # ends only because the server closed the connection
        assert len(replies) == 1 and replies[0]["ok"] is False and replies[0]["error"], payload[:40]
        assert "\n" not in replies[0]["error"]
        sock.close()
    sock = raw(info)  # a line over 1 MiB, sent without a newline
    try:
        for _ in range(MAX_LINE // 65536 + 2):
            sock.sendall(b"x" * 65536)
    except OSError:
        pass  # closed on us mid-send: also a refusal
    try:
        sock.settimeout(30)  # what is checked is the refusal, not its latency (a loaded machine is slow)
        replies = read_lines(sock)
        assert replies and replies[-1]["ok"] is False and "limit" in replies[-1]["error"]
    except ConnectionResetError:
        pass
    sock.close()
    # Wrong arguments and unknown commands are answered, and the connection stays usable.
    conn = Connection(info, timeout=30)
    for request in WRONG:
        with pytest.raises(ValueError) as refused:
            conn.call(request["cmd"], **request.get("args", {}))
        assert str(refused.value) and "internal error" not in str(refused.value), request
    assert conn.call("status")["status"] in ("running", "saving", "evaluating")
    conn.close()
    step = session.snapshot().step
    wait_until(lambda: session.snapshot().step > step + 5, "the run to keep stepping")


# -- every argument of every command, wrong -------------------------------------------------------------

CANDIDATES = ["x", "", -1, 0, 1.5, 10**9, 2**70, float("nan"), float("inf"), True, None, [], ["x"], {}, {"k": []}]


def _valid(tmp_path: Path, checkpoint: str) -> dict[str, dict]:
    """Arguments each command accepts (none is ever sent alone: each request below carries one wrong)."""
    branch = str(tmp_path / "branch")
    return {"validate": {"changes": {"learning_rate": 1e-3}}, "set": {"changes": {"learning_rate": 1e-3}},
            "sample": {"prompt": "x"}, "parse_overrides": {"text": "learning_rate=1e-3"},
            "check_branch": {"checkpoint": checkpoint, "output_dir": branch},
            "checkpoints list": {}, "checkpoints delete": {"name": checkpoint},
            "checkpoints resume_from": {"checkpoint": checkpoint},
            "checkpoints branch": {"checkpoint": checkpoint, "output_dir": branch},
            "fork": {"variants": {"a": {}}, "steps": 2}, "fork_cost": {"variants": {"a": {}}, "steps": 2},
            "keep": {"name": "a"}, "save_variant": {"name": "a", "output_dir": str(tmp_path / "variant")},
            "propose": {"changes": {"lr_scale": 0.5}}, "decide": {"id": 1, "accept": False}}


def _wrong_requests(valid: dict[str, dict]) -> list[tuple[str, dict, str]]:
    """(command, arguments, the word the refusal must name) with exactly one thing wrong each:
    every argument given every value its schema refuses, an unknown argument, a required one missing."""
    requests = []
    schemas = {**{cmd: schema for cmd, schema in SCHEMAS.items()},
               **{f"checkpoints {a}": schema for a, schema in CHECKPOINT_ACTIONS.items()}}
    for name, schema in schemas.items():
        cmd, _, action = name.partition(" ")
        base = {**({"action": action} if action else {}), **valid.get(name, {})}
        for key in schema:
            for value in CANDIDATES:
                args = {**base, key: value}
                try:
                    check_request(cmd, args)
                except ValueError:
                    requests.append((cmd, args, key))
        requests.append((cmd, {**base, "tiemout": 5}, "tiemout"))
        for key, (_, default) in schema.items():
            if default is schema_module._REQUIRED:
                requests.append((cmd, {k: v for k, v in base.items() if k != key}, key))
    # the two the issue found acting after their refusal
    requests += [("set", {**valid["set"], "timeout": "soon"}, "timeout"), ("save", {"timeout": -1}, "timeout")]
    return requests


def test_every_argument_of_every_command_is_checked_before_anything_happens(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions, save_strategy="no")
    checkpoint = Path(session.save().result(timeout=60)).name
    wait_until(lambda: "saved" in [e.kind for e in session.events_since(0)[0]], "the save's event")
    remote = attach(out)
    before_events = session.events_since(0)[1]
    edits, rows = list(session.trainer.workbench_state.live_edits), [r.name for r in session.checkpoints]
    requests = _wrong_requests(_valid(tmp_path, checkpoint))
    assert len(requests) > 150 and {cmd for cmd, _, _ in requests} >= {*SCHEMAS, "checkpoints"}
    conn = Connection(read_control(out))
    for cmd, args, key in requests:
        with pytest.raises(ValueError) as refused:
            conn.call(cmd, **args)
        said, value = str(refused.value), args.get(key)
        named = key in said or (isinstance(value, dict) and any(k in said for k in value))  # a change names its key
        assert named and "\n" not in said, (cmd, args, said)
    time.sleep(0.5)  # anything queued by mistake would land at the next step ends
    assert session.status == Status.RUNNING and not session.trainer.stop_request.is_set()
    assert session.trainer.workbench_state.live_edits == edits, "a refused set still edited the run"
    assert [r.name for r in session.checkpoints] == rows, "a refused save or delete still acted"
    assert not (tmp_path / "branch").exists() and not (tmp_path / "variant").exists()
    kinds = [e.kind for e in session.events_since(before_events)[0]]
    assert not {"paused", "edited", "saved", "evaluated", "resume_from", "branched", "proposal",
                "proposal_decided"} & set(kinds), kinds
    assert remote.status == Status.RUNNING
    conn.close()
    remote.close()


# -- hostile crowds ---------------------------------------------------------------------------------------


def test_hostile_clients_change_nothing_in_the_run(tmp_path, sessions):
    """The same fixed-length run, alone and under a crowd of bad clients, ends with the same losses."""
    def losses(out: Path, crowd: bool) -> list[float]:
        session = make_session(out, callbacks=[Slow()], max_steps=120, logging_steps=10)
        sessions.append(session.start())
        held = []
        if crowd:
            wait_until(lambda: (out / CONTROL_FILE).exists(), "control.json")
            info = read_control(out)
            half = raw(info)
            half.sendall(b'{"id": 1, "cmd": "pau')  # then dies mid-message
            half.close()
            garbage = raw(info)
            garbage.sendall(os.urandom(4096) + b"\n")
            deep = raw(info)
            deep.sendall(b"[" * 5000 + b"]" * 5000 + b"\n")
            held = [raw(info) for _ in range(40)]  # connected, silent
            stuck = raw(info)
            stuck.sendall(b'{"id": 1, "cmd": "sta')  # a half-sent line, held open
            deaf = raw(info)  # subscribes, never reads
            deaf.sendall(encode({"id": 1, "cmd": "events", "args": {"subscribe": True}}))
            flood = raw(info)
            flood.sendall(b"".join(encode({"id": i, "cmd": "status" if i % 2 else "snapshot"}) for i in range(1000)))
            silent = raw(info)  # connects, never reads a byte of its replies
            silent.sendall(b"".join(encode({"id": i, "cmd": "snapshot"}) for i in range(200)))
            got, data = 0, b""
            while got < 1000:
                chunk = flood.recv(1 << 20)
                assert chunk, "the server closed a well-behaved flood"
                data += chunk
                got = data.count(b"\n")
            replies = [json.loads(line) for line in data.splitlines()]
            assert [r["id"] for r in replies] == list(range(1000)) and all(r["ok"] for r in replies)
            held += [garbage, deep, stuck, deaf, flood, silent]
            began, spent = time.monotonic(), session._server.stats()["cpu_s"]
        assert session.wait(120) == Status.FINISHED
        if crowd:  # never spinning on a client that does not read: the thread stayed within its share
            spent = session._server.stats()["cpu_s"] - spent
            assert spent <= reactor.SERVER_SHARE * (time.monotonic() - began) + reactor.BURST_S + 0.1, spent
        for sock in held:
            sock.close()
        return [e["loss"] for e in read_events(out) if e["event"] == "log" and "loss" in e]

    quiet = losses(tmp_path / "quiet", crowd=False)
    crowded = losses(tmp_path / "crowded", crowd=True)
    assert len(quiet) == 12 and crowded == quiet


def test_a_flood_is_delayed_never_answered_early_and_the_server_stays_in_its_budget(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions, logging_steps=1)
    info = read_control(out)
    flood = raw(info)
    stop = threading.Event()
    answered = []

    def reader() -> None:
        data = b""
        while not stop.is_set():
            try:
                chunk = flood.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            data += chunk
            *lines, data = data.split(b"\n")
            answered.extend(json.loads(line)["ok"] for line in lines)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    server = session._server
    before, started = server.stats(), time.monotonic()
    # Every request asks for all there is: the whole snapshot with its curves, 2,000 points, the events.
    flood.sendall(b"".join(encode({"id": i, "cmd": ("snapshot", "series", "events")[i % 3],
                                   "args": ({}, {"points": 2000}, {"cursor": 0})[i % 3]}) for i in range(3000)))
    step = session.snapshot().step
    time.sleep(3.0)
    other = Connection(info)  # another client is answered in its turn, not after the flood
    asked = time.monotonic()
    assert other.call("status")["status"] in ("running", "saving", "evaluating")
    assert time.monotonic() - asked < 5.0
    after, elapsed = server.stats(), time.monotonic() - started
    stop.set()
    flood.close()
    other.close()
    assert answered and all(answered) and len(answered) < 3000, "the flood was not paced"
    assert after["delayed"] > before["delayed"]
    spent = after["cpu_s"] - before["cpu_s"]
    # The thread's CPU stays within its share of a core, plus one burst and the request that overdrew it.
    assert spent <= reactor.SERVER_SHARE * elapsed + reactor.BURST_S + 0.05, (spent, elapsed)
    assert session.snapshot().step > step + 10, "the run stalled under the flood"


# -- TCP: the token, its deadline, the slots -------------------------------------------------------------------


def tcp_running(out: Path, sessions: list):
    """A running Session serving TCP on a free port: (session, control.json, (host, port))."""
    session = make_session(out, callbacks=[Slow()])
    session.control_port = 0
    sessions.append(session.start())
    wait_until(lambda: (out / CONTROL_FILE).exists(), "control.json")
    info = read_control(out)
    host, port = info["tcp"].rsplit(":", 1)
    return session, info, (host, int(port))


def test_tcp_needs_the_token(tmp_path, sessions):
    out = tmp_path / "run"
    session, info, (host, port) = tcp_running(out, sessions)
    assert host == "127.0.0.1" and len(info["token"]) >= 24 and "socket" not in info
    assert stat.S_IMODE((out / CONTROL_FILE).stat().st_mode) == 0o600
    with pytest.raises(PermissionError, match="token refused"):
        attach(f"127.0.0.1:{port}", token="wrong")
    with pytest.raises(PermissionError, match="token refused"):
        attach(f"127.0.0.1:{port}")  # no token at all
    sock = socket.create_connection(("127.0.0.1", int(port)), timeout=10)  # a command before hello
    sock.sendall(encode({"id": 1, "cmd": "stop"}))
    assert read_lines(sock)[0]["ok"] is False
    assert session.status not in (Status.STOPPING, Status.STOPPED)
    remote = attach(f"127.0.0.1:{port}", token=info["token"])
    assert remote.status == session.status
    assert attach(out).snapshot().output_dir == str(out)  # through control.json, token included


def test_every_token_passes_through_the_command_line():
    """A token is typed after ``--token``: one that began with ``-`` read as an option (CI met one)."""
    from workbench.cli.usage import make_parser
    from workbench.control.server import new_token

    parser = make_parser()
    for _ in range(500):
        token = new_token()
        assert not token.startswith("-") and len(token) >= 32
        args = parser.parse_args(["ctl", "127.0.0.1:9", "status", "--token", token])
        assert args.token == token


@pytest.fixture
def small_limits(monkeypatch):
    """Caps and deadlines small enough to reach in a test (the server reads them as it goes)."""
    monkeypatch.setattr(reactor, "MAX_CLIENTS", 6)
    monkeypatch.setattr(reactor, "MAX_PENDING", 4)
    monkeypatch.setattr(reactor, "HELLO_TIMEOUT", 1.5)
    monkeypatch.setattr(reactor, "LINE_TIMEOUT", 1.5)
    monkeypatch.setattr(reactor, "IDLE_TIMEOUT", 60.0)  # lowered by the test once the slots have been fought over


def test_idle_and_unauthenticated_connections_never_lock_the_owner_out(tmp_path, sessions, small_limits,
                                                                       monkeypatch):
    session, info, address = tcp_running(tmp_path / "run", sessions)
    strangers = [socket.create_connection(address, timeout=10) for _ in range(20)]  # no token, never a word
    owners = []
    for _ in range(6):  # every slot taken by the token's holders, idle
        sock = socket.create_connection(address, timeout=10)
        sock.sendall(encode({"id": 1, "cmd": "hello", "args": {"token": info["token"]}}))
        assert one_reply(sock)["ok"]
        owners.append(sock)
    target = f"{address[0]}:{address[1]}"
    status = workbench("ctl", target, "status", "--json", f"--token={info['token']}", cwd=tmp_path)
    assert status.returncode == 0, status.stderr  # it took the slot of the one idle longest
    assert json.loads(status.stdout)["status"] in ("running", "saving", "evaluating")
    assert session._server.stats()["evicted"] >= 1
    assert "make room" in replies_until_closed(owners.pop(0), 10)[-1]["error"]
    # The oldest strangers were dropped for newer ones, the rest at the token deadline, each told why.
    notes = [replies_until_closed(s, 10) for s in strangers]
    assert all(n and n[-1]["ok"] is False and n[-1]["kind"] == "Closed" for n in notes)
    assert "no hello with the run's token within 1.5 s; connection closed" in {n[-1]["error"] for n in notes}
    assert any("waiting to present the token" in n[-1]["error"] for n in notes)
    half = socket.create_connection(address, timeout=10)
    half.sendall(encode({"id": 1, "cmd": "hello", "args": {"token": info["token"]}}))
    assert one_reply(half)["ok"]
    half.sendall(b'{"id": 2, "cmd": "sta')  # a half-sent line, left open
    assert "left unfinished for 1.5 s" in replies_until_closed(half, 10)[-1]["error"]
    monkeypatch.setattr(reactor, "IDLE_TIMEOUT", 1.0)
    for idle in owners:  # idle past IDLE_TIMEOUT: closed, and told so
        assert "idle for 1 s" in replies_until_closed(idle, 10)[-1]["error"]
    assert session.status == Status.RUNNING


class Stall(TrainerCallback):
    """Holds the training loop at the end of step 3 until released (a run busy for as long as a test needs)."""

    def __init__(self) -> None:
        self.held, self.release = threading.Event(), threading.Event()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            self.held.set()
            self.release.wait(60)


def test_a_client_refused_a_slot_gets_one_line_and_exit_code_3(tmp_path, sessions, monkeypatch):
    monkeypatch.setattr(reactor, "MAX_CLIENTS", 1)
    out = tmp_path / "run"
    stall = Stall()
    session = make_session(out, callbacks=[stall])
    sessions.append(session.start())
    assert stall.held.wait(60)
    busy = Connection(read_control(out))  # the one slot, in the middle of a save that waits for the step end
    saving = threading.Thread(target=lambda: busy.call("save", _wait=60), daemon=True)
    saving.start()
    wait_until(lambda: session._server.stats()["running"] == 1, "the save to be under way")
    with pytest.raises(Refused, match="too many clients"):
        attach(out)
    refused = workbench("ctl", out, "status", cwd=tmp_path)
    assert refused.returncode == 3, refused.stderr
    assert refused.stderr.count("\n") == 1 and "too many clients" in refused.stderr, refused.stderr
    stall.release.set()
    saving.join(60)
    assert workbench("ctl", out, "status", cwd=tmp_path).returncode == 0  # the idle slot is taken over
    busy.close()


def test_a_pooled_connection_the_server_closed_is_replaced_without_a_word(tmp_path, sessions, monkeypatch):
    monkeypatch.setattr(reactor, "IDLE_TIMEOUT", 1.0)  # the hello still says 300 s: the pool trusts it
    out = tmp_path / "run"
    running(out, sessions)
    remote = attach(out)
    assert remote.status in (Status.RUNNING, Status.SAVING, Status.EVALUATING)
    time.sleep(2.5)  # the server closes the pooled connection for idleness (and says so on it)
    assert remote.status in (Status.RUNNING, Status.SAVING, Status.EVALUATING)
    assert remote.snapshot().step > 0
    remote.close()
