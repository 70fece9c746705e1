"""How a run ended, as its clients tell it once its endpoint is gone.

A run says how it ended twice: as the last event to attached clients (``finished`` /
``failed`` with status, stop reason, saved and exit code) and in events.jsonl's ``end`` or
``error`` record (train/tracking.py), which is what ``workbench ctl`` and a dashboard
attached by output_dir read when they arrive late or lose the connection. A run killed
outright (SIGKILL, the OOM killer) writes neither; clients say that too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.core.names import EVENTS_FILE

__all__ = ["last_outcome", "describe_outcome", "end_note", "note_for"]

_TAIL = 256 * 1024  # the outcome is among the last lines; a long run's log is not read whole


def last_outcome(output_dir: str | os.PathLike, pid: object = None) -> dict[str, Any] | None:
    """How the newest run in ``output_dir`` ended (its events.jsonl ``end`` or ``error``
    record, with status and exit code); None when it has not (it is live, or was killed
    before it could say) or there is no log. With ``pid``: only that process's record (a run
    killed before its first record must not be told by its predecessor's end).

    Only the file's tail is read: a start line after the last end means a later run (a
    resume) began and has not ended."""
    path = Path(output_dir) / EVENTS_FILE
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL))
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        if not any(tag in raw for tag in (b'"end"', b'"error"', b'"start"')):
            continue  # cheap filter: most lines are logs
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # the first line of the tail may be cut
        kind = record.get("event")
        if kind == "start" or (pid is not None and record.get("pid") != pid):
            return None
        if kind == "end":
            return record
        if kind == "error":
            return {**record, "status": "failed"}
    return None


def describe_outcome(outcome: Mapping[str, Any]) -> str:
    """One line: how the run ended and the exit code ``workbench run`` gave it (the words
    are door/endings.py's, the same in every front-end)."""
    from workbench.door.endings import describe_end_record

    return f"the run {describe_end_record(outcome)}"


def end_note(output_dir: str | os.PathLike | None, pid: object = None) -> str:
    """What a client says when a run's endpoint is gone: its recorded end, or that it ended
    without recording one (killed, or its host is unreachable)."""
    return note_for(last_outcome(output_dir, pid) if output_dir is not None else None, pid)


def note_for(outcome: Mapping[str, Any] | None, pid: object = None) -> str:
    """end_note() for an outcome already read (None: the run left no record)."""
    if outcome is not None:
        return describe_outcome(outcome)
    who = f"the run (pid {pid})" if pid is not None else "the run"
    return f"{who} is gone without recording how it ended: killed (SIGKILL, out of memory) or its host is down"
