"""``attach(target)``: a RemoteSession, the SessionLike of a run served elsewhere.

The dashboard and the notebook panel take it unchanged: it answers the same calls with the
same value types (rebuilt from JSON) and raises the run's own one-line ValueError and
RuntimeError. Blocking calls (a save or evaluation queued until the next step end) return
Futures completed from a worker thread, each on a connection of its own, so polling the
snapshot never waits behind them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from workbench.control.connection import SLOW, Connection, Dropped, Refused, RemoteError, _Hangup, resolve_target
from workbench.control.discovery import NoLiveRun
from workbench.control.protocol import ProtocolError, event_from_dict, snapshot_from_dict
from workbench.control.series_delta import apply_delta
from workbench.door.schedule import ScheduleSteering
from workbench.door.values import ENDED, CheckpointRow, MemoryUsage, Proposal, SessionEvent, Snapshot, Status

__all__ = ["attach", "RemoteSession", "RemoteError", "Refused", "Dropped", "Connection", "resolve_target"]

MAX_RESTART_S = 120.0  # how long resume_from / branch wait for a live run to stop and the next to start


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

    def save_variant(self, name: str, output_dir: str | None = None, reason: str | None = None) -> str:
        return self._call("save_variant", _wait=600.0, name=name,
                          **({"output_dir": str(output_dir)} if output_dir is not None else {}),
                          **({"reason": reason} if reason is not None else {}))

    def propose(self, changes: Mapping[str, Any], reason: str | None = None, source: str | None = None) -> int:
        """Put a change on the run for anyone attached to accept or reject (see Session.propose);
        ``source``: who proposes (this client's name by default). Returns its id."""
        return int(self._call("propose", changes=dict(changes), **({"reason": reason} if reason is not None else {}),
                              **({"source": source} if source is not None else {}))["id"])

    def proposals(self) -> tuple[Proposal, ...]:
        """The run's proposals: every pending one and the newest decided ones, oldest first."""
        return tuple(Proposal.from_dict(p) for p in self._call("proposals"))

    def decide(self, proposal_id: int, accept: bool, reason: str | None = None) -> Proposal:
        """Accept or reject one of the run's proposals (recorded as decided by this client)."""
        return Proposal.from_dict(self._call("decide", id=proposal_id, accept=accept,
                                             **({"reason": reason} if reason is not None else {})))

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
