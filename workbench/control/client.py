"""``attach(target)``: a RemoteSession, the SessionLike of a run served elsewhere.

The dashboard and the notebook panel take it unchanged: it answers the same calls with the
same value types (rebuilt from JSON) and raises the run's own one-line ValueError and
RuntimeError. Blocking calls (a save or evaluation queued until the next step end) return
Futures completed from a worker thread, each on a connection of its own, so polling the
snapshot never waits behind them.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from workbench.control.discovery import NoLiveRun, check_socket_owner, read_control, stale_reason
from workbench.control.protocol import (
    MAX_LINE, PROTOCOL_VERSION, ProtocolError, decode_reply, encode, event_from_dict, snapshot_from_dict)
from workbench.control.series_delta import apply_delta
from workbench.door.schedule import ScheduleSteering
from workbench.door.values import ENDED, CheckpointRow, MemoryUsage, SessionEvent, Snapshot, Status

__all__ = ["attach", "RemoteSession", "RemoteError", "Refused", "Dropped", "Connection", "resolve_target"]

_ERRORS = {"ValueError": ValueError, "KeyError": ValueError, "TypeError": ValueError, "TimeoutError": TimeoutError,
           "PermissionError": PermissionError}


MAX_RESTART_S = 120.0  # how long resume_from / branch wait for a live run to stop and the next to start


class RemoteError(RuntimeError):
    """The server refused the message itself (protocol error, internal error)."""


class Refused(NoLiveRun):
    """The run is there but takes no connection now (every slot is in the middle of a command)."""


class Dropped(NoLiveRun):
    """The run closed this connection, and said why (idle too long, a slot needed, a deadline)."""


class _Hangup(NoLiveRun):
    """The connection closed without a word (the run ended, or closed it before reading a request)."""


_IDLE_DEFAULT = 300.0  # what a server that does not say (hello's idle_timeout) is assumed to allow


def resolve_target(target: str | Path) -> dict[str, Any]:
    """How to reach ``target``: control.json of an output_dir, or ``HOST:PORT`` (token from
    ``--token`` / the caller). NoLiveRun when an output_dir has no live run."""
    text = str(target)
    path = Path(text)
    if not path.exists() and ":" in text and not text.startswith(("/", ".")):
        host, _, port = text.rpartition(":")
        if port.isdigit():
            return {"tcp": f"{host.strip('[]')}:{port}", "token": None}
    info = read_control(path)
    why = stale_reason(info)
    if why:
        raise NoLiveRun(f"no live run in {target}: {why}")
    return info


class Unanswered(NoLiveRun):
    """The run took the connection but did not say hello within the timeout: busy or frozen,
    not gone (to a new client it is no live run; to one already attached, a slow one)."""


# What a late answer raises: the run is slow, not ended.
SLOW = (TimeoutError, Unanswered)


class Connection:
    """One socket to the server: request, reply; or a stream of events once subscribed."""

    def __init__(self, info: Mapping[str, Any], token: str | None = None, timeout: float = 5.0,
                 client: str = "remote") -> None:
        self._ids = itertools.count(1)
        self._buffer = bytearray()
        self.timeout = timeout
        try:
            if info.get("socket"):
                check_socket_owner(info["socket"])  # PermissionError: not an OSError we report as "no run"
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(str(info["socket"]))
            else:
                host, _, port = str(info["tcp"]).rpartition(":")
                self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        except PermissionError:
            raise
        except OSError as exc:
            where = info.get("socket") or info.get("tcp")
            raise NoLiveRun(f"no live run answers at {where} ({exc.strerror or exc})") from None
        where = info.get("socket") or info.get("tcp")
        try:
            # ``client`` names who connects (ctl, attach, remote): the run's console and the
            # stop reason of a stop asked here say it (door/endings.py).
            self.hello = self.call("hello", token=token or info.get("token"), client=client)
        except PermissionError:  # a wrong token: said as it is
            self.close()
            raise
        except NoLiveRun as exc:  # Refused, Dropped, a hang-up: the run is there but took no connection
            self.close()
            raise type(exc)(f"the run at {where} refused the connection: {exc}") from None
        except (OSError, ProtocolError, RemoteError) as exc:
            self.close()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            raise (Unanswered if isinstance(exc, TimeoutError) else NoLiveRun)(
                f"the run at {where} did not answer ({why})") from None
        self.idle_timeout = float(self.hello.get("idle_timeout") or _IDLE_DEFAULT)
        self.used = time.monotonic()
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            self.close()
            raise RemoteError(f"the run speaks control protocol {self.hello.get('protocol')}, this client "
                              f"{PROTOCOL_VERSION}; use the same workbench version on both sides")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _line(self, timeout: float | None) -> bytes:
        self.sock.settimeout(timeout)
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE:
                raise ProtocolError("reply over the line limit")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise _Hangup("the run closed the connection (it has ended, or refused the message)")
            self._buffer += chunk
        line, self._buffer = bytes(self._buffer[:end]), self._buffer[end + 1:]
        return line

    def call(self, cmd: str, _wait: float | None = None, **args: Any) -> Any:
        """Send one request and return its result; the server's error as the same exception type."""
        ident = next(self._ids)
        self.used = time.monotonic()
        self.sock.settimeout(self.timeout)
        try:
            self.sock.sendall(encode({"id": ident, "cmd": cmd, "args": args}))
        except (BrokenPipeError, ConnectionResetError):
            self._parting_words()
            raise
        while True:
            reply = decode_reply(self._line(_wait or self.timeout))
            if "event" in reply:  # a subscribed connection interleaves events; requests there are rare
                continue
            break
        self.used = time.monotonic()
        if reply.get("ok"):
            return reply.get("result")
        error, kind = str(reply.get("error", "error")), str(reply.get("kind"))
        if kind in ("Closed", "Busy"):  # the server closes this connection, and says why
            raise (Dropped if kind == "Closed" else Refused)(error)
        raise _ERRORS.get(kind, RuntimeError if kind == "RuntimeError" else RemoteError)(error)

    def _parting_words(self) -> None:
        """The server closed the connection before our request went out: raise what it said
        on its way out (a refusal, a deadline), if it said anything."""
        try:
            reply = decode_reply(self._line(0.5))
        except (OSError, ProtocolError, NoLiveRun):
            return
        if reply.get("kind") in ("Closed", "Busy") and not reply.get("ok"):
            raise (Dropped if reply["kind"] == "Closed" else Refused)(str(reply.get("error")))

    def stream(self, cursor: int = 0, timeout: float | None = None) -> Iterator[tuple[SessionEvent, int]]:
        """Subscribe and yield (event, cursor) as they happen (the backlog after ``cursor`` first)
        until the run ends, the connection closes, or nothing arrives for ``timeout``."""
        result = self.call("events", cursor=cursor, subscribe=True)
        for data in result["events"]:
            yield event_from_dict(data), result["cursor"]
        while True:
            try:
                message = decode_reply(self._line(timeout))
            except (TimeoutError, NoLiveRun, OSError):
                return
            if "event" in message:
                yield event_from_dict(message["event"]), int(message["cursor"])


class RemoteSession(ScheduleSteering):
    """SessionLike over the control protocol (see workbench.door.protocol for each call)."""

    # A branch started in the run's process serves its own folder: attach to it there (the
    # branch command's reply and the parent's events name it).
    successor = None

    def __init__(self, info: Mapping[str, Any], token: str | None = None, timeout: float = 5.0,
                 client: str = "remote") -> None:
        self.info = dict(info)
        self.token = token
        self.timeout = timeout
        self.client = client
        self._pool: list[Connection] = []
        self._pool_lock = threading.Lock()
        first = Connection(self.info, token, timeout, client)
        self.hello = first.hello
        self._pool.append(first)
        self._snapshot: Snapshot = Snapshot.empty()
        self._series_version: str | None = None  # the server's name for the curves in _snapshot
        self._closed = False
        # Attached through an output_dir on this host: a restarted run there (--resume: same
        # folder, new pid) is followed, and once the run is gone its recorded outcome is read.
        folder = self.info.get("output_dir")
        self.output_dir = Path(folder) if folder and "socket" in self.info and Path(folder).is_dir() else None
        self._offset = 0  # events of the runs followed before this one: cursors keep counting
        self._cursor = 0  # the newest cursor handed out
        self._followed: dict[str, Any] | None = None  # a restart to announce in the events
        self._end: dict[str, Any] | None = None  # how the run ended: its last event, or its record
        self._told_end = False  # a "gone" event (or the run's own last event) was handed out

    def __repr__(self) -> str:
        return f"RemoteSession({self.info.get('socket') or self.info.get('tcp')}, run={self.hello.get('run_name')!r})"

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, cmd: str, _wait: float | None = None, **args: Any) -> Any:
        try:
            return self._call_once(cmd, _wait, args)
        except PermissionError:
            raise
        except (OSError, ProtocolError, NoLiveRun):
            if not self._follow_restart():
                raise
        return self._call_once(cmd, _wait, args)

    def _follow_restart(self) -> bool:
        """The endpoint went away: if a newer run now serves the same output_dir (a
        ``--resume`` restart), talk to it from now on and return True."""
        if self.output_dir is None or self._closed:
            return False
        try:
            info = resolve_target(self.output_dir)
        except (NoLiveRun, OSError):
            return False
        if (info.get("pid"), info.get("started")) == (self.info.get("pid"), self.info.get("started")):
            return False
        try:
            first = Connection(info, None, self.timeout, self.client)
        except (NoLiveRun, OSError, ProtocolError, RemoteError):
            return False
        with self._pool_lock:
            old, self._pool = self._pool, [first]
            self.info, self.hello = dict(info), first.hello
            self._offset, self._snapshot, self._end, self._told_end = self._cursor, Snapshot.empty(), None, False
            self._series_version = None
            self._followed = {"pid": info.get("pid"), "note": f"a restarted run (pid {info.get('pid')}) "
                                                              "serves this output_dir now; following it"}
        for conn in old:
            conn.close()
        return True

    def _pooled(self) -> Connection | None:
        """A pooled connection the server has not closed for idleness meanwhile (or None)."""
        now = time.monotonic()
        with self._pool_lock:
            while self._pool:
                conn = self._pool.pop()
                if now - conn.used < conn.idle_timeout / 2:
                    return conn
                conn.close()
        return None

    def _call_once(self, cmd: str, _wait: float | None, args: dict[str, Any]) -> Any:
        conn = self._pooled()
        reused = conn is not None
        if conn is None:
            conn = Connection(self.info, self.token, self.timeout, self.client)
        try:
            result = conn.call(cmd, _wait=_wait, **args)
        except (Dropped, _Hangup, ConnectionResetError, BrokenPipeError):
            conn.close()
            # A pooled connection the server closed (idle, or its slot given to another client)
            # before this request reached it: the server never read it, so it goes again, once,
            # on a new connection (which fails the same way if the run itself has gone).
            if not reused:
                raise
            return self._call_once(cmd, _wait, args)
        except (OSError, ProtocolError):
            conn.close()
            raise
        except BaseException:
            with self._pool_lock:
                self._pool.append(conn)
            raise
        with self._pool_lock:
            if len(self._pool) < 4:
                self._pool.append(conn)
            else:
                conn.close()
        return result

    def _future(self, cmd: str, key: str, convert=lambda v: v, **args: Any) -> Future:
        future: Future = Future()

        def work() -> None:
            try:
                result = self._call(cmd, _wait=args.get("timeout", 120.0) + 5.0, **args)
                future.set_result(convert(result[key]))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the Future
                future.set_exception(exc)

        threading.Thread(target=work, name=f"workbench-remote-{cmd}", daemon=True).start()
        return future

    def close(self) -> None:
        """Close this client's connections (the run is not affected: detaching)."""
        self._closed = True
        with self._pool_lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()

    detach = close

    # -- watching --------------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        try:
            return Status(self._call("status")["status"])
        except SLOW:  # a busy run answers late: it is still where it was last seen
            return self._snapshot.status
        except (NoLiveRun, OSError):
            return self._ended_status()

    def _ended_status(self) -> Status:
        # The endpoint is gone: the run has ended; the last snapshot says how, if it got that far.
        status = self._snapshot.status
        if status in ENDED:
            return status
        recorded = self._ended_record().get("status")
        return Status(recorded) if recorded in {s.value for s in ENDED} else Status.STOPPED

    @property
    def stop_reason(self) -> str | None:
        try:
            return self._call("status")["stop_reason"]
        except SLOW:
            return self._snapshot.stop_reason
        except (NoLiveRun, OSError):
            return self._ended_record().get("stop_reason")

    def snapshot(self) -> Snapshot:
        """The run's newest snapshot; the same object as last time when nothing changed."""
        try:
            data = self._call("snapshot", since=self._snapshot.updated or None, series_since=self._series_version,
                              series_delta=2)
            series = None if data.get("unchanged") else self._series_from(data)
        except SLOW:
            # Slow, not gone: a run under load (2 busy cores, a long save) can miss the
            # client's timeout; taking that for its end would report it stopped while it trains.
            return self._snapshot
        except (NoLiveRun, OSError):
            if self._snapshot.status not in ENDED:
                from dataclasses import replace

                self._snapshot = replace(self._snapshot, status=self._ended_status())
            return self._snapshot
        if not data.get("unchanged"):
            self._snapshot = snapshot_from_dict(data, series=series)
            self._series_version = data.get("series_version")
        return self._snapshot

    def _series_from(self, data: dict) -> dict[str, tuple] | None:
        """The curves of a snapshot reply that left them out or sent a delta (None: it sent them)."""
        if data.get("series_unchanged"):
            return self._snapshot.series  # the same object: a front-end's identity check skips a redraw
        if "series_delta" in data:
            try:
                return apply_delta(self._snapshot.series, data["series_delta"])
            except (ValueError, TypeError):  # does not fit what we hold: ask for the whole curves
                data.update(self._call("snapshot"))
        return None

    def series(self, points: int = 200, names: list[str] | None = None) -> dict[str, list[tuple[int, float]]]:
        """The run's curves, thinned on the run's side to at most ``points`` points each."""
        data = self._call("series", points=points, names=names)
        return {k: [(int(s), float(v)) for s, v in pts] for k, pts in data.items()}

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        """Events after ``cursor``. Cursors keep counting across a followed restart; once the
        run is gone without a last event, one ``gone`` event says how it ended, if known."""
        offset = self._offset
        try:
            result = self._call("events", cursor=max(0, cursor - offset))
            if self._offset != offset:  # the call followed a restart: read the new run from its start
                result = self._call("events", cursor=max(0, cursor - self._offset))
            pages = [result]
            while result.get("more") and len(pages) < 64:  # replies are pages cut by size
                result = self._call("events", cursor=int(result["cursor"]))
                pages.append(result)
        except SLOW:
            return [], cursor  # slow, not gone: the events come on the next poll
        except (NoLiveRun, OSError):
            return self._gone_events(), cursor
        events = [event_from_dict(e) for page in pages for e in page["events"]]
        followed, self._followed = self._followed, None
        if followed is not None:
            events.insert(0, SessionEvent("followed", 0, time.time(), followed))
        for event in events:
            if event.kind in ("finished", "failed"):
                self._end, self._told_end = {"step": event.step, **event.data}, True
        self._cursor = self._offset + int(result["cursor"])
        return events, self._cursor

    def _ended_record(self) -> dict[str, Any]:
        """How the run ended: its last event if this client saw it, else events.jsonl's record
        (kept once found), else a note that it is gone without one (read again next time: a
        run still writing its record must not be told as gone for good)."""
        if self._end is not None:
            return self._end
        from workbench.control.outcome import last_outcome, note_for

        pid = self.info.get("pid")
        outcome = last_outcome(self.output_dir, pid) if self.output_dir is not None else None
        end = {**(outcome or {}), "note": note_for(outcome, pid)}
        if outcome is not None:
            self._end = end
        return end

    def _gone_events(self) -> list[SessionEvent]:
        if self._told_end:
            return []  # its last event came through, or it was already reported gone
        self._told_end = True
        end = self._ended_record()
        return [SessionEvent("gone", int(end.get("step", self._snapshot.step)), time.time(), dict(end))]

    def end_note(self) -> str | None:
        """One line on how the run ended (stop reason, exit code), or None while it runs."""
        if self.status not in ENDED:
            return None
        end = self._ended_record()
        if end.get("note"):
            return str(end["note"])
        from workbench.control.outcome import describe_outcome

        return describe_outcome({"step": self._snapshot.step, **end})

    def events(self, cursor: int = 0, timeout: float | None = None) -> Iterator[SessionEvent]:
        """Events as they happen (after ``cursor``), on a connection of their own, until the run ends."""
        conn = Connection(self.info, self.token, self.timeout, self.client)
        try:
            for event, _ in conn.stream(cursor, timeout):
                yield event
        finally:
            conn.close()

    def arguments(self) -> dict[str, Any]:
        return self._call("arguments")

    # -- lifecycle and commands --------------------------------------------------------------

    def start(self) -> "RemoteSession":
        """An attached run is already started; starting it again is refused."""
        status = self.status
        if status == Status.IDLE or status in ENDED:
            raise RuntimeError(f"start: the remote run is {status}; start runs where they run (workbench run)")
        return self

    def wait(self, timeout: float | None = None) -> Status:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status
            if status in ENDED:
                break
            if deadline is not None and time.monotonic() > deadline:
                return status
            time.sleep(0.1)
        snap = self.snapshot()
        if status == Status.FAILED and snap.error:
            raise RuntimeError(snap.error)
        return status

    def pause(self, wait: bool = False, timeout: float | None = None) -> Status:
        limit = 600.0 if timeout is None else timeout
        return Status(self._call("pause", _wait=limit + 5.0 if wait else None, wait=wait,
                                 **({"timeout": limit} if wait else {})))

    def resume(self) -> Status:
        return Status(self._call("resume"))

    def stop(self, save: bool = True, reason: str | None = None) -> Status:
        """Stop the run (saving first unless ``save=False``). ``reason`` is not sent: the run
        records this client's name (``client``) as the stop's reason."""
        return Status(self._call("stop", save=save))

    def save(self) -> Future:
        return self._future("save", "checkpoint", Path)

    def evaluate(self) -> Future:
        return self._future("evaluate", "metrics")

    def validate_edits(self, changes: Mapping[str, Any], reason: str | None = None) -> dict[str, Any]:
        return self._call("validate", changes=dict(changes), **({"reason": reason} if reason is not None else {}))

    def set(self, reason: str | None = None, **changes: Any) -> Future:
        """Change hyperparameters live; ``reason`` is stored with the edit (record and event)."""
        self.validate_edits(changes, reason)  # refused here, at once, like the local Session's set()
        why = {"reason": reason} if reason is not None else {}
        return self._future("set", "applied", changes=changes, **why)

    def fork(self, variants: Mapping[str, Mapping[str, Any]], steps: int, evaluate: bool = True,
             max_memory: int | None = None, timeout: float = 3600.0) -> dict[str, Any]:
        """Fork the paused run into variants (see Session.fork); waits up to ``timeout`` seconds
        for the variants to train, then returns the report."""
        return self._call("fork", _wait=timeout, variants={k: dict(v) for k, v in variants.items()}, steps=steps,
                          evaluate=evaluate, **({"max_memory": max_memory} if max_memory is not None else {}))

    def fork_cost(self, variants: Mapping[str, Mapping[str, Any]], steps: int,
                  max_memory: int | None = None) -> dict[str, Any]:
        return self._call("fork_cost", variants={k: dict(v) for k, v in variants.items()}, steps=steps,
                          **({"max_memory": max_memory} if max_memory is not None else {}))

    def keep(self, name: str, reason: str | None = None) -> dict[str, Any]:
        return self._call("keep", name=name, **({"reason": reason} if reason is not None else {}))

    def discard(self) -> None:
        self._call("discard")

    def lr_plan(self, schedule: Mapping[str, Any] | str | None = None) -> tuple[tuple[int, float], ...]:
        """The planned learning rate for the rest of the run; with ``schedule``, after that change."""
        reply = self._call("lr_plan", **({"schedule": schedule} if schedule is not None else {}))
        return tuple((int(s), float(v)) for s, v in reply)

    # -- looking inside ------------------------------------------------------------------------------

    def memory(self) -> MemoryUsage:
        return MemoryUsage.from_dict(self._call("memory"))

    def inspect(self) -> dict[str, Any]:
        return self._call("inspect")

    def sample(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int | None = 20,
               seed: int = 0) -> str:
        return self._call("sample", _wait=120.0, prompt=prompt, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, seed=seed)

    # -- checkpoints -----------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointRow]:
        rows: list[dict[str, Any]] = []
        while True:  # the catalog comes in pages cut by size
            page = self._call("checkpoints", action="list", offset=len(rows))
            rows += page["rows"]
            if not page.get("more") or not page["rows"]:
                return [CheckpointRow.from_dict(r) for r in rows]

    def delete_checkpoint(self, name: str) -> None:
        self._call("checkpoints", action="delete", name=name)

    def resume_from(self, checkpoint: str | Path, *, other_run: bool = False, **overrides: Any) -> "RemoteSession":
        """Restart the run from ``checkpoint`` (a name in its output_dir, or a path there;
        another run's only with ``other_run``), in its own process: a live run is stopped
        without saving first, once the checkpoint is known to verify and fit. Returns once the
        new run has started; this client stays attached (the endpoint is the same)."""
        self._call("checkpoints", _wait=MAX_RESTART_S + 5.0, action="resume_from", checkpoint=str(checkpoint),
                   overrides=overrides, other_run=other_run, timeout=MAX_RESTART_S)
        return self

    def parse_overrides(self, text: str | Mapping[str, str]) -> dict[str, Any]:
        return self._call("parse_overrides", text=text if isinstance(text, str) else dict(text))

    def check_branch(self, checkpoint: str | Path, output_dir: str | Path, *, other_run: bool = False,
                     **overrides: Any) -> dict[str, Any]:
        return self._call("check_branch", checkpoint=str(checkpoint), output_dir=str(output_dir), overrides=overrides,
                          other_run=other_run)

    def branch(self, checkpoint: str | Path, output_dir: str | Path, save: bool = True, *, other_run: bool = False,
               **overrides: Any) -> "RemoteSession":
        """Start a branch from ``checkpoint`` into ``output_dir`` (a new or empty folder, as
        the run's process sees it) in the run's process, and return a client attached to it.
        A live run is stopped first, with a checkpoint unless ``save=False``, once everything
        the branch needs is checked."""
        reply = self._call("checkpoints", _wait=MAX_RESTART_S + 5.0, action="branch", checkpoint=str(checkpoint),
                           output_dir=str(output_dir), overrides=overrides, save=save, other_run=other_run,
                           timeout=MAX_RESTART_S)
        if not reply.get("control"):
            raise RemoteError(f"the branch in {reply.get('output_dir')} serves no control endpoint")
        return RemoteSession(reply["control"], timeout=self.timeout)

    def panel(self, autopilot: Any = None) -> Any:
        """The Jupyter panel on this remote run (needs ipywidgets); with ``autopilot``, its
        Autopilot tab shows that autopilot's proposals and decisions."""
        from workbench.widgets.notebook import Panel

        return Panel(self, autopilot=autopilot)


def attach(target: str | Path, token: str | None = None, timeout: float = 5.0,
           client: str = "remote") -> RemoteSession:
    """Attach to the live run at ``target``: its output_dir (control.json says where it
    listens), or ``HOST:PORT`` of a TCP endpoint (pass ``token``). Raises NoLiveRun with
    one line when nothing answers there (including a stale control.json). ``client``: who
    this is ("ctl", "attach", "remote"), said by the run when this client steers it."""
    info = resolve_target(target)
    return RemoteSession(info, token=token, timeout=timeout, client=client)
