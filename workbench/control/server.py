"""The control server: a live run's endpoint for ``workbench ctl``, ``attach`` and scripts.

It runs on its own threads on rank 0 and touches the run only through the Session's public
methods (the same ones the dashboard calls), so every command is checked by the Session's
own rules and reaches the loop through its queue. Replies and events are read from the
Session's immutable snapshot and event history. Nothing here ever holds a lock the training
thread waits on while it talks to a client, so a slow, dead or hostile client can only lose
its own connection:

- one thread per connection, a bounded number of connections (MAX_CLIENTS);
- lines are capped at MAX_LINE; a malformed message gets an error reply and the
  connection is closed;
- sends time out (SEND_TIMEOUT): a client that stops reading is dropped;
- commands from all clients are serialized (one at a time into the Session); waiting for
  a queued save or evaluation happens outside that lock.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.control.discovery import remove_control, socket_path, write_control
from workbench.control.protocol import (
    MAX_LINE, PROTOCOL_VERSION, ProtocolError, decode_request, downsample, encode, event_to_dict, reply_error,
    reply_ok, snapshot_to_dict)
from workbench.control.series_delta import SeriesVersions
from workbench.session.protocol import SessionLike
from workbench.session.state import ENDED

__all__ = ["ControlServer", "MAX_CLIENTS", "SEND_TIMEOUT"]

log = logging.getLogger("workbench")

MAX_CLIENTS = 32
SEND_TIMEOUT = 10.0  # seconds a client may take to read a reply before it is dropped
POLL_S = 0.1  # how often a subscribed connection looks for new events
MAX_WAIT_S = 600.0  # the longest a request may wait for a queued command


# Every endpoint this process serves: one that outlives its run (a Session started with
# start()) is closed when a newer one serves the same output_dir, or at exit.
_SERVING: set["ControlServer"] = set()
_SERVING_LOCK = threading.Lock()


def _close_all() -> None:
    with _SERVING_LOCK:
        servers = list(_SERVING)
    for server in servers:
        server.close(grace=0.2)


atexit.register(_close_all)


class _Refused(Exception):
    """Close the connection after the error reply (bad token, broken protocol)."""


def _bool(args: dict, key: str, default: bool) -> bool:
    value = args.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value


def _number(args: dict, key: str, default: float | None, low: float = 0.0, high: float = MAX_WAIT_S) -> float | None:
    value = args.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{key}: expected a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


class ControlServer:
    """Serve one Session over a Unix socket (default) or TCP (``port``; token required)."""

    def __init__(self, session: SessionLike, output_dir: str | os.PathLike, port: int | None = None,
                 host: str | None = None) -> None:
        self.session = session
        self.output_dir = Path(output_dir)
        self.port = port
        self.host = host or "127.0.0.1"  # loopback unless the user names another address
        self.token = secrets.token_urlsafe(24) if port is not None else None
        self.info: dict[str, Any] = {}
        self._listener: socket.socket | None = None
        self._closing = threading.Event()
        self._serial = threading.Lock()  # one command at a time into the Session
        self._clients: set[threading.Thread] = set()
        self._clients_lock = threading.Lock()
        self._accepter: threading.Thread | None = None
        self._snap_cache: tuple[Any, dict] | None = None  # (snapshot, its fields but the series)
        self._series_versions = SeriesVersions()  # what each snapshot poller holds, to send deltas
        self._handlers: dict[str, Callable[[dict], Any]] = {
            "hello": self._hello, "status": self._status, "snapshot": self._snapshot, "events": self._events,
            "series": self._series, "arguments": lambda a: session.arguments(),
            "memory": lambda a: session.memory().to_dict(), "pause": self._pause,
            "resume": lambda a: str(session.resume()), "stop": lambda a: str(session.stop(save=_bool(a, "save", True))),
            "save": self._save, "evaluate": self._evaluate, "validate": self._validate, "set": self._set,
            "inspect": lambda a: session.inspect(), "sample": self._sample, "checkpoints": self._checkpoints,
            "parse_overrides": lambda a: session.parse_overrides(a.get("text", "")),
            "check_branch": self._check_branch,
        }

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Bind, write control.json, and serve on a daemon thread; returns control.json's content."""
        info: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": socket.gethostname(),
                                "started": time.time(), "output_dir": str(self.output_dir.resolve())}
        if self.port is None:
            path = socket_path(f"{os.getpid()}-{secrets.token_hex(4)}.sock")
            path.unlink(missing_ok=True)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            os.chmod(path, 0o600)
            info["socket"] = str(path)
        else:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            info["tcp"] = f"{self.host}:{listener.getsockname()[1]}"
            info["token"] = self.token
        listener.listen(16)
        listener.settimeout(0.25)  # the accept loop notices close() this often
        self._listener = listener
        self.info = info
        self._retire_ended(info["output_dir"])
        write_control(self.output_dir, info)
        with _SERVING_LOCK:
            _SERVING.add(self)
        self._accepter = threading.Thread(target=self._accept_loop, name="workbench-control", daemon=True)
        self._accepter.start()
        return info

    def _retire_ended(self, output_dir: str) -> None:
        """Close this process's endpoints on ``output_dir`` whose runs have ended: this one replaces them."""
        with _SERVING_LOCK:
            older = [s for s in _SERVING if s is not self and s.info.get("output_dir") == output_dir]
        for server in older:
            try:
                ended = server.session.status in ENDED
            except ReferenceError:  # its Session is gone (its own close is on the way)
                ended = True
            if ended:
                server.close(grace=0.2)

    def close(self, grace: float = 1.0) -> None:
        """Stop serving: subscribed clients get the last events, then every connection closes;
        control.json and the socket file are removed."""
        with _SERVING_LOCK:
            if self not in _SERVING:
                return  # closed already (or never started)
            _SERVING.discard(self)
        with self._clients_lock:
            attached = any(t.is_alive() for t in self._clients)
        if attached:  # pollers (the dashboard polls at ~4 Hz) get to read the final snapshot
            time.sleep(min(grace, 0.3))
        self._closing.set()
        if self._accepter is not None:
            self._accepter.join(grace)
        with self._clients_lock:
            clients = list(self._clients)
        deadline = time.monotonic() + grace
        for thread in clients:
            thread.join(max(deadline - time.monotonic(), 0.0))
        if self._listener is not None:
            self._listener.close()
        remove_control(self.output_dir, os.getpid(), endpoint=self.info)
        if "socket" in self.info:
            Path(self.info["socket"]).unlink(missing_ok=True)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._clients_lock:
                self._clients = {t for t in self._clients if t.is_alive()}
                if len(self._clients) >= MAX_CLIENTS:
                    self._send_quietly(conn, reply_error(None, f"too many clients (at most {MAX_CLIENTS})"))
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn,), name="workbench-control-client",
                                          daemon=True)
                self._clients.add(thread)
            thread.start()

    # -- one connection ---------------------------------------------------------------------

    def _doorbell(self) -> tuple[socket.socket, Callable[[], None]] | None:
        """A socket that becomes readable when the Session emits an event, and its closer.

        The Session's subscriber queue is watched by one small thread that rings the bell
        (one byte on a socketpair), so a subscribed connection wakes at once instead of
        every POLL_S: command-to-event latency is the network's, not the poll's. None when
        the session offers no subscribe() (the POLL_S loop then still delivers)."""
        subscribe = getattr(self.session, "subscribe", None)
        unsubscribe = getattr(self.session, "unsubscribe", None)
        if subscribe is None or unsubscribe is None:
            return None
        bell, ringer = socket.socketpair()
        ringer.setblocking(False)
        events = subscribe(1000)

        def ring() -> None:
            while events.get() is not None:  # None: the connection closed
                try:
                    ringer.send(b"!")
                except BlockingIOError:
                    pass  # already rung and not yet read: one ring is enough
                except OSError:
                    return

        def close() -> None:
            unsubscribe(events)  # nothing more arrives: make room, then tell the ringer to end
            while not events.empty():
                try:
                    events.get_nowait()
                except Exception:  # noqa: BLE001 - emptied meanwhile by the ringer
                    break
            events.put(None)
            bell.close()
            ringer.close()

        threading.Thread(target=ring, name="workbench-control-bell", daemon=True).start()
        return bell, close

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(SEND_TIMEOUT)
        state = {"authed": self.token is None, "subscribed": False, "cursor": 0}
        buffer = bytearray()
        doorbell = None
        try:
            while not self._closing.is_set():
                if state["subscribed"] and doorbell is None:
                    doorbell = self._doorbell()
                watched = [conn] if doorbell is None else [conn, doorbell[0]]
                ready, _, _ = select.select(watched, [], [], POLL_S)
                if doorbell is not None and doorbell[0] in ready:
                    doorbell[0].recv(4096)  # the rings themselves carry nothing
                readable = conn in ready
                if readable:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return  # the client hung up (possibly mid-message: the partial line is dropped)
                    buffer += chunk
                    while (end := buffer.find(b"\n")) >= 0:
                        line, buffer = bytes(buffer[:end]), buffer[end + 1:]
                        if line.strip():
                            self._answer(conn, line, state)
                    if len(buffer) > MAX_LINE:
                        raise _Refused(f"line over the {MAX_LINE}-byte limit")
                if state["subscribed"]:
                    self._push_events(conn, state)
            if state["subscribed"]:  # the run ended: hand over its last events before closing
                self._push_events(conn, state)
        except _Refused as exc:
            self._send_quietly(conn, reply_error(None, str(exc)))
        except (OSError, ValueError):
            pass  # a dead or stalled client: only its connection ends
        finally:
            if doorbell is not None:
                doorbell[1]()
            conn.close()

    def _answer(self, conn: socket.socket, line: bytes, state: dict) -> None:
        try:
            ident, cmd, args = decode_request(line)
        except ProtocolError as exc:
            raise _Refused(str(exc)) from None
        if not state["authed"]:
            token = args.get("token") if cmd == "hello" else None
            if not isinstance(token, str) or not hmac.compare_digest(token, self.token or ""):
                conn.sendall(encode(reply_error(ident, PermissionError("token refused: pass the token from "
                                                                       "control.json"))))
                raise _Refused("token refused")
            state["authed"] = True
        handler = self._handlers.get(cmd)
        if handler is None:
            reply = reply_error(ident, ValueError(f"unknown command {cmd!r}; known: {', '.join(sorted(self._handlers))}"))
        else:
            try:
                result = handler(args)
                if cmd == "events" and args.get("subscribe"):
                    state["subscribed"], state["cursor"] = True, result["cursor"]
                reply = reply_ok(ident, result)
            except (ValueError, RuntimeError, TypeError, KeyError, TimeoutError, OSError) as exc:
                reply = reply_error(ident, exc)
            except Exception as exc:  # noqa: BLE001 - a bug answers one client, never ends the run
                log.warning("control: %s failed: %s", cmd, exc, exc_info=True)
                reply = reply_error(ident, f"internal error in {cmd}: {type(exc).__name__}: {exc}")
        try:
            data = encode(reply)
        except ProtocolError as exc:
            data = encode(reply_error(ident, exc))
        conn.sendall(data)

    def _push_events(self, conn: socket.socket, state: dict) -> None:
        events, cursor = self.session.events_since(state["cursor"])
        state["cursor"] = cursor
        if events:
            conn.sendall(b"".join(encode({"event": event_to_dict(e), "cursor": cursor}) for e in events))

    @staticmethod
    def _send_quietly(conn: socket.socket, message: dict) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(encode(message))
        except OSError:
            pass

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run one Session command; commands from all clients go in one at a time."""
        with self._serial:
            return fn()

    @staticmethod
    def _await(value: Any, args: dict, what: str) -> tuple[bool, Any]:
        """(done, result) of a command that may have been queued (a Future)."""
        if not hasattr(value, "result"):
            return True, value
        if not _bool(args, "wait", True):
            return False, None
        timeout = _number(args, "timeout", 120.0)
        try:
            return True, value.result(timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"{what}: still queued after {timeout:g} s; it runs at the next step end") from None

    # -- commands ---------------------------------------------------------------------------

    def _hello(self, args: dict) -> dict:
        snap = self.session.snapshot()
        return {"protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": socket.gethostname(),
                "started": self.info.get("started"), "run_name": snap.run_name, "output_dir": snap.output_dir,
                "status": str(self.session.status)}

    def _status(self, args: dict) -> dict:
        snap = self.session.snapshot()
        return {"status": str(self.session.status), "stop_reason": self.session.stop_reason, "step": snap.step,
                "max_steps": snap.max_steps, "epoch": snap.epoch, "steps_per_second": snap.steps_per_second,
                "eta": snap.eta, "loss": snap.latest("loss"), "learning_rate": snap.latest("learning_rate"),
                "best_metric": snap.best_metric, "run_name": snap.run_name, "output_dir": snap.output_dir}

    def _snapshot(self, args: dict) -> dict:
        snap = self.session.snapshot()
        since = args.get("since")
        if since is not None and since == snap.updated:
            return {"unchanged": True}
        fields = self._snapshot_fields(snap)
        if not _bool(args, "series", True):
            return fields
        # A client that holds the curves gets what changed in them: a few hundred bytes a poll.
        inserts = args.get("series_delta") == 2  # the client reads deltas with inserted points
        return {**fields, **self._series_versions.reply(snap.series, args.get("series_since"), inserts)}

    def _snapshot_fields(self, snap: Any) -> dict:
        """Everything of ``snap`` but its series, converted once per published snapshot
        however many clients poll it."""
        cached = self._snap_cache
        if cached is not None and cached[0] is snap:
            return cached[1]
        data = snapshot_to_dict(snap, series=False)
        self._snap_cache = (snap, data)
        return data

    def _events(self, args: dict) -> dict:
        cursor = args.get("cursor", 0)
        events, cursor = self.session.events_since(cursor)
        return {"events": [event_to_dict(e) for e in events], "cursor": cursor}

    def _series(self, args: dict) -> dict:
        points = args.get("points", 200)
        if isinstance(points, bool) or not isinstance(points, int) or not 1 <= points <= 100_000:
            raise ValueError(f"points: expected a whole number from 1 to 100000, got {points!r}")
        names = args.get("names")
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            raise ValueError("names: expected a list of series names")
        series = self.session.snapshot().series
        return {k: downsample(v, points) for k, v in series.items() if names is None or k in names}

    def _pause(self, args: dict) -> str:
        wait = _bool(args, "wait", False)
        timeout = _number(args, "timeout", 60.0)
        if not wait:
            return str(self._call(lambda: self.session.pause()))
        self._call(lambda: self.session.pause())
        # The wait itself is outside the command lock: other clients keep being answered.
        return str(self.session.pause(wait=True, timeout=timeout))

    def _save(self, args: dict) -> dict:
        done, path = self._await(self._call(self.session.save), args, "save")
        return {"checkpoint": str(path)} if done else {"queued": True}

    def _evaluate(self, args: dict) -> dict:
        done, metrics = self._await(self._call(self.session.evaluate), args, "evaluate")
        return {"metrics": metrics} if done else {"queued": True}

    @staticmethod
    def _changes(args: dict) -> dict:
        changes = args.get("changes")
        if not isinstance(changes, dict) or not changes:
            raise ValueError("set: expected changes as an object, e.g. {\"learning_rate\": 1e-4}")
        return changes

    @staticmethod
    def _reason(args: dict) -> dict:
        """``{"reason": text}`` when the client gave one (a SessionLike without reasons still works)."""
        reason = args.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"reason: expected text, got {type(reason).__name__}")
        return {"reason": reason} if reason else {}

    def _validate(self, args: dict) -> dict:
        return self.session.validate_edits(self._changes(args), **self._reason(args))

    def _set(self, args: dict) -> dict:
        changes, why = self._changes(args), self._reason(args)
        done, applied = self._await(self._call(lambda: self.session.set(**why, **changes)), args, "set")
        return {"applied": applied} if done else {"queued": True}

    def _sample(self, args: dict) -> str:
        prompt = args.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("sample: expected a prompt string")
        options = {k: args[k] for k in ("max_new_tokens", "temperature", "top_k", "seed") if k in args}
        return self._call(lambda: self.session.sample(prompt, **options))

    def _checkpoints(self, args: dict) -> Any:
        action = args.get("action", "list")
        if action == "list":
            return [row.to_dict() for row in self.session.checkpoints]
        if action == "delete":
            name = args.get("name")
            if not isinstance(name, str):
                raise ValueError("checkpoints delete: expected a checkpoint name such as checkpoint-40")
            self._call(lambda: self.session.delete_checkpoint(name))
            return {"deleted": name}
        if action == "resume_from":
            return self._resume_from(args)
        if action == "branch":
            return self._branch(args)
        raise ValueError(f"checkpoints: unknown action {action!r}; use list, delete, resume_from or branch")

    def _checkpoint_path(self, args: dict, what: str) -> Path:
        """The checkpoint a request names: a name in the run's output_dir, or a path there."""
        name = args.get("checkpoint")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"checkpoints {what}: expected a checkpoint name such as checkpoint-40 "
                             "(see checkpoints list)")
        path = Path(name)
        return path if path.is_absolute() or len(path.parts) > 1 else self.output_dir / name

    @staticmethod
    def _overrides(args: dict, what: str) -> dict:
        overrides = args.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"checkpoints {what}: overrides must be an object, e.g. {{\"learning_rate\": 1e-4}}")
        return overrides

    def _restartable(self, what: str) -> Callable[..., Any]:
        method = getattr(self.session, "restart_from" if what == "resume_from" else "branch_from", None)
        if method is None:
            raise RuntimeError(f"checkpoints {what}: this run cannot be restarted remotely")
        return method

    def _resume_from(self, args: dict) -> dict:
        """Restart the run from a checkpoint: a live run is stopped without saving first; the
        endpoint stays (the same Session trains again)."""
        path = self._checkpoint_path(args, "resume_from")
        overrides = self._overrides(args, "resume_from")
        restart = self._restartable("resume_from")
        done, status = self._await(self._call(lambda: restart(path, **overrides)), args, "resume_from")
        return {"checkpoint": path.name, "status": str(status)} if done else {"queued": True}

    def _branch(self, args: dict) -> dict:
        """Start a branch as a new run in the run's process (a live run is stopped first, saved
        unless ``save`` is false); the reply names the branch's own endpoint."""
        path = self._checkpoint_path(args, "branch")
        output_dir = args.get("output_dir")
        if not isinstance(output_dir, str):
            raise ValueError("checkpoints branch: expected output_dir, the branch's own folder")
        overrides = self._overrides(args, "branch")
        save = _bool(args, "save", True)
        branch = self._restartable("branch")
        done, child = self._await(self._call(lambda: branch(path, output_dir, save=save, **overrides)), args,
                                  "branch")
        if not done:
            return {"queued": True}
        server = getattr(child, "_server", None)
        endpoint = dict(server.info) if server is not None else None
        return {"checkpoint": path.name, "output_dir": str(Path(child.trainer.args.output_dir).resolve()),
                "control": endpoint,
                "status": str(child.status)}

    def _check_branch(self, args: dict) -> dict:
        overrides = args.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ValueError("check_branch: overrides must be an object")
        return self.session.check_branch(str(args.get("checkpoint", "")), str(args.get("output_dir", "")),
                                         **overrides)
