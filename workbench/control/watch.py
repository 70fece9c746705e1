"""``workbench watch OUTDIR``: a run shown read-only.

A live run is attached to and wrapped so that nothing can steer it (:class:`ReadOnly`); a
finished, stopped or crashed run is rebuilt from its files (:class:`RecordedRun`):
events.jsonl gives the curves, edits, samples and how it ended, the checkpoint store its catalog.
Both are SessionLike, so the dashboard shows them unchanged; every command is refused with
one line saying why.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from workbench.control.discovery import NoLiveRun
from workbench.door.values import (
    SNAPSHOT_EDITS, SNAPSHOT_INTERVENTIONS, CheckpointRow, Intervention, MemoryUsage, SeriesStore, SessionEvent,
    Snapshot, Status)

__all__ = ["RecordedRun", "ReadOnly", "open_watch", "text_summary"]

# events.jsonl's record names -> the SessionEvent kinds a live Session emits for them.
_EVENT_KINDS = {"log": "logged", "eval": "evaluated", "save": "saved", "pause": "paused", "resume": "resumed",
                "edit": "edited", "start": "started", "end": "finished", "error": "failed", "sample": "sampled"}


class _Refusing:
    """The commands of a read-only SessionLike: each one refused with the same line."""

    why = "read-only"
    successor = None  # a recorded or watched run is shown as it is; a branch is watched in its own folder

    def _refuse(self, what: str) -> Any:
        raise RuntimeError(f"{what}: {self.why}")

    def close(self) -> None:
        """Stop watching (a live run's connections close; the run is not affected)."""
        remote = getattr(self, "remote", None)
        if remote is not None:
            remote.close()

    def start(self) -> Any:
        return self

    def pause(self, wait: bool = False, timeout: float | None = None) -> Status:
        return self._refuse("pause")

    def resume(self) -> Status:
        return self._refuse("resume")

    def stop(self, save: bool = True, reason: str | None = None) -> Status:
        return self._refuse("stop")

    def save(self) -> Future | Path:
        return self._refuse("save")

    def evaluate(self) -> Future | dict[str, float]:
        return self._refuse("evaluate")

    def validate_edits(self, changes: Mapping[str, Any], reason: str | None = None) -> dict[str, Any]:
        return self._refuse("set")

    def set(self, reason: str | None = None, **changes: Any) -> Any:
        return self._refuse("set")

    def fork(self, variants: Mapping[str, Mapping[str, Any]], steps: int, evaluate: bool = True,
             max_memory: int | None = None) -> dict[str, Any]:
        return self._refuse("fork")

    def fork_cost(self, variants: Mapping[str, Mapping[str, Any]], steps: int,
                  max_memory: int | None = None) -> dict[str, Any]:
        return self._refuse("fork")

    def keep(self, name: str, reason: str | None = None) -> dict[str, Any]:
        return self._refuse("keep")

    def discard(self) -> None:
        self._refuse("discard")

    def save_variant(self, name: str, output_dir: str | None = None, reason: str | None = None) -> str:
        return self._refuse("save_variant")

    def lr_plan(self, schedule: Mapping[str, Any] | str | None = None) -> tuple[tuple[int, float], ...]:
        if schedule is not None:
            return self._refuse("set")
        return self.snapshot().lr_plan  # type: ignore[attr-defined] - both read-only runs have one

    def propose(self, changes: Mapping[str, Any], reason: str | None = None, source: str | None = None) -> int:
        """Refused: a watched run takes no proposal from here."""
        return self._refuse("propose")

    def proposals(self) -> tuple[Any, ...]:
        """The proposals the run publishes (shown, never decided, here)."""
        return self.snapshot().proposals  # type: ignore[attr-defined] - both read-only runs have one

    def decide(self, proposal_id: int, accept: bool, reason: str | None = None) -> Any:
        """Refused: proposals are decided where the run is steered (attach, ctl)."""
        return self._refuse("accept" if accept else "reject")

    def inspect(self) -> dict[str, Any]:
        return self._refuse("inspect")

    def sample(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int | None = 20,
               seed: int = 0) -> str:
        return self._refuse("sample")

    def delete_checkpoint(self, name: str) -> None:
        self._refuse("delete")

    def resume_from(self, checkpoint: str | Path) -> Any:
        return self._refuse("resume_from")

    def parse_overrides(self, text: str | Mapping[str, str]) -> dict[str, Any]:
        return self._refuse("branch")

    def check_branch(self, checkpoint: str | Path, output_dir: str | Path, **overrides: Any) -> dict[str, Any]:
        return self._refuse("branch")

    def branch(self, checkpoint: str | Path, output_dir: str | Path, save: bool = True, **overrides: Any) -> Any:
        return self._refuse("branch")


class RecordedRun(_Refusing):
    """A run that has ended, rebuilt from ``output_dir``'s events.jsonl and checkpoints."""

    why = "this run has ended; it is shown from its files (workbench run --resume to continue it)"

    def __init__(self, output_dir: str | Path) -> None:
        from workbench.checkpoint.store import CheckpointStore
        from workbench.core.event_file import read_events

        self.output_dir = Path(output_dir)
        if not self.output_dir.is_dir():
            raise NotADirectoryError(f"{output_dir} is not a directory; pass a run's output_dir")
        records = read_events(self.output_dir)
        if not records and not CheckpointStore(self.output_dir).list():
            raise FileNotFoundError(f"{output_dir} holds no events.jsonl and no checkpoints; nothing to watch")
        self._events = [SessionEvent(kind=_EVENT_KINDS.get(r.get("event", ""), str(r.get("event"))),
                                     step=int(r.get("step", 0)), time=float(r.get("time", 0.0)),
                                     data={k: v for k, v in r.items() if k not in ("event", "step", "time")})
                        for r in records]
        self._rows = CheckpointStore(self.output_dir).list()
        self._stop_reason: str | None = None
        self._snapshot = self._build(records)

    def _build(self, records: list[dict[str, Any]]) -> Snapshot:
        series = SeriesStore()
        status, error, max_steps, step, run_name, edits = Status.STOPPED, None, 0, 0, None, []
        interventions: list[Intervention] = []
        health: dict[str, Any] = {}  # the end record's time ledger, the last log's rates, a hang
        first = last = paused_at = None
        paused = 0.0  # seconds between pause and resume records: not training time
        for r in records:
            kind, at = r.get("event"), int(r.get("step", 0))
            if kind == "pause" and paused_at is None:
                paused_at = r.get("time")
            elif kind in ("resume", "start", "end", "error") and isinstance(paused_at, (int, float)):
                paused += max(float(r.get("time", paused_at)) - paused_at, 0.0)
                paused_at = None
            step = max(step, at)
            first = r.get("time") if first is None else first
            last = r.get("time", last)
            if kind == "start":
                max_steps, run_name = int(r.get("max_steps") or 0), r.get("run_name")
                status, error = Status.STOPPED, None  # a later start (resume) supersedes an earlier end
                self._stop_reason = None
            elif kind == "log":
                series.add_log(at, r)
                rates = {k: r[k] for k in ("train_samples_per_second", "train_tokens_per_second", "mfu") if k in r}
                if rates:
                    health["throughput"] = rates
            elif kind == "hang":
                health["hang"] = {k: v for k, v in r.items() if k != "event"}
            elif kind == "hang_cleared":
                health.pop("hang", None)  # its rank moved on
            elif kind == "straggler":
                health.setdefault("stragglers", {"ranks": []})["ranks"].append(r)
            elif kind == "eval":
                series.add_eval(at, {k: v for k, v in r.items() if k not in ("event", "step", "time", "epoch")})
            elif kind == "edit":
                edits.append({k: v for k, v in r.items() if k != "event"})
            elif kind == "guard":
                interventions.append(Intervention.from_record(r))
            elif kind == "end":
                status = Status.FINISHED if r.get("status") == "finished" else Status.STOPPED
                self._stop_reason = r.get("stop_reason")
                if r.get("time_ledger"):
                    health["ledger"] = r["time_ledger"]
                health.pop("hang", None)  # a resumed run that ended is past its hang
            elif kind == "error":
                status, error = Status.FAILED, r.get("error")
        elapsed = float(last - first) if isinstance(first, (int, float)) and isinstance(last, (int, float)) else 0.0
        return Snapshot(status=status, step=step, max_steps=max_steps, elapsed=max(elapsed - paused, 0.0),
                        paused=paused, stop_reason=self._stop_reason, series=series.frozen(),
                        checkpoints=tuple(self._rows), edits=tuple(edits[-SNAPSHOT_EDITS:]), edit_count=len(edits),
                        error=error,
                        interventions=tuple(interventions[-SNAPSHOT_INTERVENTIONS:]),
                        guard_interventions=len(interventions), run_name=run_name,
                        output_dir=str(self.output_dir), updated=float(last or 0.0), health=health or None)

    @property
    def status(self) -> Status:
        return self._snapshot.status

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        return self._events[cursor:], len(self._events)

    def arguments(self) -> dict[str, Any]:
        return {}

    def wait(self, timeout: float | None = None) -> Status:
        return self.status

    def memory(self) -> MemoryUsage:
        return self._refuse("memory")

    @property
    def checkpoints(self) -> list[CheckpointRow]:
        return list(self._rows)


class ReadOnly(_Refusing):
    """A live run's RemoteSession with every steering command refused (watching only)."""

    why = "workbench watch is read-only; use workbench attach or workbench ctl to steer the run"

    def __init__(self, remote: Any) -> None:
        self.remote = remote

    @property
    def status(self) -> Status:
        return self.remote.status

    @property
    def stop_reason(self) -> str | None:
        return self.remote.stop_reason

    @property
    def checkpoints(self) -> list[CheckpointRow]:
        return self.remote.checkpoints

    def snapshot(self) -> Snapshot:
        return self.remote.snapshot()

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        return self.remote.events_since(cursor)

    def arguments(self) -> dict[str, Any]:
        return self.remote.arguments()

    def memory(self) -> MemoryUsage:
        return self.remote.memory()

    def wait(self, timeout: float | None = None) -> Status:
        return self.remote.wait(timeout)


def text_summary(session: Any) -> list[str]:
    """The run in plain lines, for ``workbench watch`` whose output is not a terminal (a pipe,
    a file, CI): how it ended or where it is, the best checkpoint, the final metrics, the
    checkpoints and the files; no escape codes."""
    from workbench.widgets.view import TERMINAL, elapsed_text, progress_line, summary_lines

    snap = session.snapshot()
    lines = summary_lines(snap)
    name = snap.run_name or Path(snap.output_dir or ".").name
    lines[0] = f"{name}: {lines[0]}"
    if snap.status not in TERMINAL:  # a live run: where it is now, and how to follow or steer it
        lines.insert(1, f"{progress_line(snap)} · {elapsed_text(snap)}")
        lines.append(f"live: workbench watch {snap.output_dir} on a terminal follows it; workbench attach / ctl steer it")
    rows = list(session.checkpoints)
    if rows:
        shown = ", ".join(row.name for row in rows[-5:])
        lines.append(f"checkpoints: {shown}" + (f" (and {len(rows) - 5} older)" if len(rows) > 5 else ""))
    return lines


def open_watch(output_dir: str | Path) -> RecordedRun | ReadOnly:
    """The live run in ``output_dir`` (read-only), or its recording when nothing answers."""
    from workbench.control.client import attach

    try:
        return ReadOnly(attach(output_dir))
    except NoLiveRun:
        return RecordedRun(output_dir)
