"""The control server: a live run's endpoint for ``workbench ctl``, ``attach`` and scripts.

It touches the run only through the Session's public methods (the same ones the dashboard
calls), so every command is checked by the Session's own rules and reaches the loop through
its queue. Nothing here holds a lock the training thread waits on while it talks to a
client, and no client can make the server cost the run more than a bounded share of a core:

- one thread serves every connection (reactor.py): non-blocking sockets, CPU budgets per
  connection and for the server (a flooding client's replies are delayed, not computed),
  slots and deadlines (a token deadline over TCP, an idle timeout, a slot always found for
  the owner's client);
- the read commands (snapshot, series, events, status) are answered from the Session's
  published snapshot and event history, encoded once per published object and shared by
  every client (replies.py), and bounded in size whatever the run's history;
- every request is checked whole against its command's schema (requests.py) before
  anything happens, and a malformed one is an error reply, never a traceback;
- the commands that may take a while (a save, a pause with wait, a sample, a restart) run
  on a worker thread each; commands from all clients still reach the Session one at a time.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.control.discovery import remove_control, socket_path, write_control
from workbench.control.protocol import (
    MAX_LINE, PROTOCOL_VERSION, ProtocolError, decode_request, encode, reply_error, reply_ok, to_json)
from workbench.control.reactor import (
    IDLE_TIMEOUT, MAX_CLIENTS, SEND_TIMEOUT, Deferred, Final, Link, Reactor)
from workbench.control.replies import PAGE_BYTES, ReplyCache, map_json, ok_line, page
from workbench.control.requests import check_request
from workbench.control.series_delta import SeriesVersions
from workbench.door.callers import calling_as
from workbench.door.values import LOOP_HELD
from workbench.door.protocol import SessionLike
from workbench.door.values import ENDED

__all__ = ["ControlServer", "MAX_CLIENTS", "SEND_TIMEOUT"]

log = logging.getLogger("workbench")

# steering commands
_TOLD = frozenset({"pause", "resume", "stop", "save", "evaluate", "set", "checkpoints", "propose", "decide",
                   "fork", "keep", "save_variant", "discard"})
POLL_S = 0.1  # how often subscribed connections look for new events when the Session has no doorbell
_ANSWERED = (ValueError, RuntimeError, TypeError, KeyError, TimeoutError, OSError)  # the Session's refusals


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


def _error_line(ident: int | None, error: BaseException | str) -> bytes:
    return encode(reply_error(ident, error))


def new_token() -> str:
    """A TCP endpoint's secret: 192 random bits as hex.

    Hex, not URL-safe base64: a token that began with ``-`` (one in 64 of those) read as an
    option to ``workbench ctl HOST:PORT status --token TOKEN`` and the command refused it.
    """
    return secrets.token_hex(24)


class ControlServer:
    """Serve one Session over a Unix socket (default) or TCP (``port``; token required)."""

    def __init__(self, session: SessionLike, output_dir: str | os.PathLike, port: int | None = None,
                 host: str | None = None) -> None:
        self.session = session
        self.output_dir = Path(output_dir)
        self.port = port
        self.host = host or "127.0.0.1"  # loopback unless the user names another address
        self.token = new_token() if port is not None else None
        self.info: dict[str, Any] = {}
        # Where the run tells what its clients did, one line each (the CLI's console: headless
        # runs print it); None: nowhere (the dashboard's event log shows the events already).
        self.announce: Callable[[str], None] | None = None
        self._listener: socket.socket | None = None
        self._closing = threading.Event()
        self._serial = threading.Lock()  # one command at a time into the Session
        self._reactor: Reactor | None = None
        self._accepter: threading.Thread | None = None
        self._doorbell: queue.Queue | None = None  # the Session's events, rung into the reactor
        self._replies = ReplyCache()  # the read replies, encoded once per published object
        self._series_versions = SeriesVersions()  # what each snapshot poller holds, to send deltas
        # Answered on the reactor's thread from the published copies (cheap, never blocking) ...
        self._inline: dict[str, Callable[[dict, Link], Any]] = {
            "hello": self._hello, "status": self._status, "snapshot": self._snapshot, "events": self._events,
            "series": self._series, "arguments": lambda a, _: session.arguments(),
            "validate": self._validate, "parse_overrides": lambda a, _: session.parse_overrides(a["text"]),
            "proposals": lambda a, _: [p.to_dict() for p in session.proposals()],
        }
        # ... and on a worker thread each: these take the Session's lock, read files or wait.
        self._workers: dict[str, Callable[[dict], Any]] = {
            "memory": lambda a: session.memory().to_dict(), "pause": self._pause,
            "resume": lambda a: str(session.resume()),
            # The stop's reason is the client's name: the end record and every front-end say who stopped it.
            "stop": lambda a: str(session.stop(save=a["save"], reason=a["client"])),
            "save": self._save, "evaluate": self._evaluate, "set": self._set,
            "inspect": lambda a: session.inspect(), "sample": self._sample, "checkpoints": self._checkpoints,
            "check_branch": self._check_branch,
            "lr_plan": lambda a: [list(p) for p in session.lr_plan(a["schedule"])],
            "fork": lambda a: session.fork(a["variants"], a["steps"], evaluate=a["evaluate"], max_memory=a["max_memory"]),
            "fork_cost": lambda a: session.fork_cost(a["variants"], a["steps"], max_memory=a["max_memory"]),
            "keep": lambda a: session.keep(a["name"], **self._reason(a)),
            "discard": lambda a: session.discard(),
            "save_variant": lambda a: session.save_variant(a["name"], a["output_dir"], **self._reason(a)),
            "propose": self._propose, "decide": self._decide,
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
        listener.listen(64)
        self._listener = listener
        self.info = info
        self._reactor = Reactor(listener, tcp=self.port is not None, handle=self._handle, push=self._push,
                                closing=self._closing, poll_s=POLL_S,
                                training=lambda: self.session.status not in LOOP_HELD)
        self._retire_ended(info["output_dir"])
        write_control(self.output_dir, info)
        with _SERVING_LOCK:
            _SERVING.add(self)
        self._accepter = threading.Thread(target=self._reactor.run, name="workbench-control", daemon=True)
        self._accepter.start()
        return info

    def stats(self) -> dict[str, Any]:
        """What the endpoint has done: requests answered and delayed, connections evicted,
        refused and timed out, open connections, and the CPU seconds its thread used."""
        reactor = self._reactor
        if reactor is None:
            return {}
        return {**reactor.stats, "connections": reactor.connections(), "cpu_s": reactor.cpu_seconds()}

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
        reactor = self._reactor
        if reactor is not None and reactor.connections():  # pollers (~3 Hz) get to read the final snapshot
            time.sleep(min(grace, 0.3))
        self._closing.set()
        if reactor is not None:
            reactor.wake()
        if self._accepter is not None:
            self._accepter.join(grace + 0.5)
        doorbell, self._doorbell = self._doorbell, None
        if doorbell is not None:
            try:
                self.session.unsubscribe(doorbell)
            except ReferenceError:  # the Session is gone (this close is its finalizer): nothing rings
                pass
            _drain(doorbell)
            doorbell.put(None)  # the ringer ends
        if self._listener is not None:
            self._listener.close()
        remove_control(self.output_dir, os.getpid(), endpoint=self.info)
        if "socket" in self.info:
            Path(self.info["socket"]).unlink(missing_ok=True)

    # -- one request -------------------------------------------------------------------------

    def _handle(self, link: Link, line: bytes) -> bytes | Deferred:
        """Answer one request line of ``link``: the reply, or a Deferred for a worker thread."""
        try:
            ident, cmd, raw = decode_request(line)
        except ProtocolError as exc:
            return Final(_error_line(None, exc))  # a broken line: the connection is closed after the reply
        if not link.authed:
            token = raw.get("token") if cmd == "hello" else None
            if not isinstance(token, str) or not hmac.compare_digest(token, self.token or ""):
                return Final(_error_line(ident, PermissionError("token refused: pass the token from control.json")))
            refusal = self._reactor.admit(link) if self._reactor is not None else None
            if refusal is not None:
                return Final(encode({"id": ident, "ok": False, "error": refusal, "kind": "Busy"}))
        try:
            args = check_request(cmd, raw)
        except ValueError as exc:
            return _error_line(ident, exc)
        inline = self._inline.get(cmd)
        if inline is not None:
            return self._reply(ident, cmd, lambda: inline(args, link))
        work = self._workers[cmd]
        args["client"] = link.client
        return Deferred(lambda: self._reply(ident, cmd, lambda: self._steered(cmd, args, work)))

    def _steered(self, cmd: str, args: dict, work: Callable[[dict], Any]) -> Any:
        """Run a worker command; a steering one (pause, resume, stop, save, evaluate, set, a
        checkpoint action) is then told on the run's own console, when it has one (announce.py).
        It runs as its client (door/callers.py): a refusal says what that client can do
        (``workbench ctl runs/x pause --wait``, not ``session.pause(wait=True)``)."""
        with calling_as(args["client"]):
            result = work(args)
        announce = self.announce
        if announce is None or cmd not in _TOLD:
            return result
        from workbench.control.announce import announcement, tell_when_paused

        try:
            if cmd == "pause":
                tell_when_paused(lambda: self.session.status, lambda: self.session.snapshot().step, args["client"],
                                 announce)
            else:
                line = announcement(cmd, args, result, args["client"], self.session.snapshot().step)
                if line:
                    announce(line)
        except Exception as exc:  # noqa: BLE001 - telling must never fail the command it tells
            log.debug("control: could not announce %s: %s", cmd, exc)
        return result

    @staticmethod
    def _reply(ident: int, cmd: str, fn: Callable[[], Any]) -> bytes:
        """The reply line to ``fn()``'s result (bytes: a result encoded already), or its error."""
        try:
            result = fn()
            data = ok_line(ident, result) if isinstance(result, bytes) else encode(reply_ok(ident, result))
        except ProtocolError as exc:  # a result over the line limit
            return _error_line(ident, exc)
        except _ANSWERED as exc:
            return _error_line(ident, exc)
        except Exception as exc:  # noqa: BLE001 - a bug answers one client, never ends the run
            log.warning("control: %s failed: %s", cmd, exc, exc_info=True)
            return _error_line(ident, f"internal error in {cmd}: {type(exc).__name__}: {exc}")
        if len(data) > MAX_LINE:
            return _error_line(ident, ProtocolError(f"the {cmd} reply of {len(data)} bytes is over the "
                                                    f"{MAX_LINE}-byte line limit"))
        return data

    def _push(self, link: Link) -> tuple[bytes, bool]:
        """The event lines a subscribed ``link`` has not had (a page of them), and whether more wait."""
        try:
            events, total = self.session.events_since(link.cursor)
        except (ValueError, ReferenceError):
            return b"", False
        first = total - len(events)
        lines = [b'{"event":%b,"cursor":%d}\n' % (self._replies.event(e), first + i + 1) for i, e in enumerate(events)]
        count = page(lines)
        link.cursor = first + count
        return b"".join(lines[:count]), count < len(lines)

    def _ring_on_events(self) -> None:
        """Subscribe to the Session's events once, and ring the reactor on each (subscribed
        connections hear an event at once, not at the next poll)."""
        if self._doorbell is not None or self._reactor is None:
            return
        subscribe = getattr(self.session, "subscribe", None)
        if subscribe is None or not hasattr(self.session, "unsubscribe"):
            self._reactor.poll_events = True
            return
        events = self._doorbell = subscribe(64)
        reactor = self._reactor

        def ring() -> None:
            while events.get() is not None:  # None: the endpoint closed
                reactor.ring()

        threading.Thread(target=ring, name="workbench-control-bell", daemon=True).start()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run one Session command; commands from all clients go in one at a time."""
        with self._serial:
            return fn()

    @staticmethod
    def _await(value: Any, args: dict, what: str) -> tuple[bool, Any]:
        """(done, result) of a command that may have been queued (a Future); ``wait`` and
        ``timeout`` were checked with the request."""
        if not hasattr(value, "result"):
            return True, value
        if not args["wait"]:
            return False, None
        try:
            return True, value.result(timeout=args["timeout"])
        except TimeoutError:
            raise TimeoutError(f"{what}: still queued after {args['timeout']:g} s; it runs at the next step end") from None

    # -- commands ---------------------------------------------------------------------------

    def _hello(self, args: dict, link: Link) -> dict:
        link.client = args["client"] or "remote"
        snap = self.session.snapshot()
        return {"protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": socket.gethostname(),
                "started": self.info.get("started"), "run_name": snap.run_name, "output_dir": snap.output_dir,
                "status": str(self.session.status), "idle_timeout": IDLE_TIMEOUT}

    def _status(self, args: dict, link: Link) -> dict:
        snap = self.session.snapshot()
        return {"status": str(self.session.status), "stop_reason": self.session.stop_reason, "step": snap.step,
                "max_steps": snap.max_steps, "epoch": snap.epoch, "steps_per_second": snap.steps_per_second,
                "eta": snap.eta, "loss": snap.latest("loss"), "learning_rate": snap.latest("learning_rate"),
                "elapsed": snap.elapsed, "paused": snap.paused,  # training time, and the pauses apart
                "best_metric": snap.best_metric, "run_name": snap.run_name, "output_dir": snap.output_dir,
                "health": snap.health}

    def _snapshot(self, args: dict, link: Link) -> bytes:
        """The snapshot's fields (encoded once per published snapshot) and its curves: whole,
        unchanged, or what changed since the version the client holds (series_delta.py)."""
        snap = self.session.snapshot()
        if args["since"] is not None and args["since"] == snap.updated:
            return b'{"unchanged":true}'
        fields = self._replies.fields(snap)
        if not args["series"]:
            return fields[:-1] + b',"series":{}}'
        part = self._series_versions.reply(snap.series, args["series_since"], args["series_delta"] == 2)
        if "series" in part:
            body = b'"series_version":%b,"series":%b' % (to_json(part["series_version"]),
                                                         self._replies.series(snap.series))
        else:  # unchanged, or a delta: the curves' key is there, empty (as clients before deltas read it)
            body = map_json(part.items())[1:-1] + b',"series":{}'
        return fields[:-1] + b"," + body + b"}"

    def _events(self, args: dict, link: Link) -> bytes:
        """A page of the events after ``cursor`` (``more``: another page follows); with
        ``subscribe`` the rest, and every later event, arrive as event lines."""
        events, total = self.session.events_since(args["cursor"])
        result, cursor = self._replies.events_page(events, total)
        if args["subscribe"]:
            link.subscribed, link.cursor = True, cursor
            self._ring_on_events()
            if cursor < total and self._reactor is not None:
                self._reactor.ring()
        return result

    def _series(self, args: dict, link: Link) -> bytes:
        return self._replies.series(self.session.snapshot().series, args["points"], args["names"])

    def _pause(self, args: dict) -> str:
        status = self._call(lambda: self.session.pause())
        if not args["wait"]:
            return str(status)
        # The wait itself is outside the command lock: other clients keep being answered.
        return str(self.session.pause(wait=True, timeout=args["timeout"]))

    def _save(self, args: dict) -> dict:
        done, path = self._await(self._call(self.session.save), args, "save")
        return {"checkpoint": str(path)} if done else {"queued": True}

    def _evaluate(self, args: dict) -> dict:
        done, metrics = self._await(self._call(self.session.evaluate), args, "evaluate")
        return {"metrics": metrics} if done else {"queued": True}

    @staticmethod
    def _reason(args: dict) -> dict:
        """``{"reason": text}`` when the client gave one (a SessionLike without reasons still works)."""
        return {"reason": args["reason"]} if args["reason"] else {}

    def _validate(self, args: dict, link: Link) -> dict:
        return self.session.validate_edits(args["changes"], **self._reason(args))

    def _set(self, args: dict) -> dict:
        changes, why = args["changes"], self._reason(args)
        done, applied = self._await(self._call(lambda: self.session.set(**why, **changes)), args, "set")
        return {"applied": applied} if done else {"queued": True}

    def _propose(self, args: dict) -> dict:
        """A proposal put on the run; its source is the client's name unless the request names one."""
        source = args["source"] or args["client"]
        ident = self._call(lambda: self.session.propose(args["changes"], reason=args["reason"], source=source))
        return {"id": ident}

    def _decide(self, args: dict) -> dict:
        """Accept or reject a proposal, as this client (calling_as: the decision records its name)."""
        proposal = self._call(lambda: self.session.decide(args["id"], args["accept"], reason=args["reason"]))
        return proposal.to_dict()

    def _sample(self, args: dict) -> str:
        options = {k: args[k] for k in ("max_new_tokens", "temperature", "top_k", "seed")}
        return self._call(lambda: self.session.sample(args["prompt"], **options))

    def _checkpoints(self, args: dict) -> Any:
        action = args["action"]
        if action == "list":
            return self._catalog_page(args["offset"])
        if action == "delete":
            name = args["name"]
            self._call(lambda: self.session.delete_checkpoint(name))
            return {"deleted": name}
        if action == "resume_from":
            return self._resume_from(args)
        return self._branch(args)

    def _catalog_page(self, offset: int) -> bytes:
        """``{"rows": [...], "total": n, "offset": k, "more": bool}``: the catalog from row
        ``offset``, cut to one page by size (RemoteSession.checkpoints reads every page)."""
        rows = self.session.checkpoints
        pieces = [to_json(row.to_dict()) for row in rows[offset:]]
        count = page(pieces, PAGE_BYTES)
        more = b"true" if count < len(pieces) else b"false"
        return b'{"rows":[%b],"total":%d,"offset":%d,"more":%b}' % (b",".join(pieces[:count]), len(rows), offset, more)

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
        # The Session resolves the name and checks everything before the live run stops.
        name, other_run = args["checkpoint"], args["other_run"]
        overrides = self._overrides(args, "resume_from")
        restart = self._restartable("resume_from")
        done, status = self._await(self._call(lambda: restart(name, other_run=other_run, **overrides)), args,
                                   "resume_from")
        return {"checkpoint": Path(name).name, "status": str(status)} if done else {"queued": True}

    def _branch(self, args: dict) -> dict:
        """Start a branch as a new run in the run's process (a live run is stopped first, saved
        unless ``save`` is false); the reply names the branch's own endpoint."""
        name, other_run = args["checkpoint"], args["other_run"]
        output_dir = args.get("output_dir")
        if not isinstance(output_dir, str):
            raise ValueError("checkpoints branch: expected output_dir, the branch's own folder")
        overrides = self._overrides(args, "branch")
        save = args["save"]
        branch = self._restartable("branch")
        done, child = self._await(self._call(lambda: branch(name, output_dir, save=save, other_run=other_run,
                                                            **overrides)), args, "branch")
        if not done:
            return {"queued": True}
        server = getattr(child, "_server", None)
        endpoint = dict(server.info) if server is not None else None
        return {"checkpoint": Path(name).name, "output_dir": str(Path(child.trainer.args.output_dir).resolve()),
                "control": endpoint,
                "status": str(child.status)}

    def _check_branch(self, args: dict) -> dict:
        return self.session.check_branch(args["checkpoint"], args["output_dir"], other_run=args["other_run"],
                                         **args["overrides"])


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
