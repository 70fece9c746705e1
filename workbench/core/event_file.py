"""``output_dir/events.jsonl``: the run's record, one JSON object a line, written by the main
process (logs, evaluations, saves, edits, guard records, how the run ended) and read back by
clients that find a run gone, by ``workbench watch`` and by the tests. Always strict JSON:
non-finite numbers are written as strings."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from workbench.core.names import EVENTS_FILE

__all__ = ["EventFile", "read_events", "error_recorded", "EVENTS_FILE"]


def _clean(value: Any) -> Any:
    """JSON-safe value: non-finite floats become strings ("nan", "inf") rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class EventFile:
    """Appends one JSON object a line to ``events.jsonl``; safe to call from several threads."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / EVENTS_FILE
        self._lock = threading.Lock()

    def write(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Append ``{"event", "time", "step", **fields}`` and return it."""
        record = {"event": event, "time": time.time(), "step": step, **_clean(fields)}
        line = json.dumps(record, allow_nan=False)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return record


def read_events(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of a run directory, in order (a torn last line is ignored)."""
    path = Path(output_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def error_recorded(output_dir: str | os.PathLike, pid: int) -> bool:
    """Whether the last record of ``events.jsonl`` is process ``pid``'s error record (a
    full or read-only disk may have refused it: then nothing should point there)."""
    try:
        with open(Path(output_dir) / EVENTS_FILE, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - (1 << 20), 0))  # the record ends the file
            record = json.loads(f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1])
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("event") == "error" and record.get("pid") == pid
