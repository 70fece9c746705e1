"""Where logs go: ``output_dir/events.jsonl`` (always, on the main process) and, by
``report_to``, extra sinks. Sinks are plain callbacks, so they see exactly what the loop
reports through ``on_log`` / ``on_evaluate`` / ``on_save``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from .callbacks import TrainerCallback

__all__ = ["EventLog", "EventLogCallback", "reporting_callbacks", "read_events"]

EVENTS_FILE = "events.jsonl"


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


class EventLog:
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


class EventLogCallback(TrainerCallback):
    """Writes start, log, eval, save, end and error events (main process only)."""

    def __init__(self) -> None:
        self.log: EventLog | None = None

    def _out(self, args, state) -> EventLog | None:
        if not state.is_world_process_zero:
            return None
        if self.log is None or self.log.path.parent != Path(args.output_dir):
            self.log = EventLog(args.output_dir)
        return self.log

    def on_train_begin(self, args, state, control, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("start", state.global_step, max_steps=state.max_steps, run_name=args.run_name,
                      num_train_epochs=state.num_train_epochs, train_batch_size=state.train_batch_size)

    def on_log(self, args, state, control, logs=None, **kwargs):
        out = self._out(args, state)
        if out and logs and not any(k.startswith(("eval_", "test_")) for k in logs):
            out.write("log", state.global_step, **logs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("eval", state.global_step, epoch=state.epoch, **(metrics or {}))

    def on_save(self, args, state, control, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("save", state.global_step, checkpoint=f"checkpoint-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("end", state.global_step, epoch=state.epoch, status="stopped" if
                      state.global_step < state.max_steps else "finished")

    def on_error(self, args, state, control, error=None, **kwargs):
        out = self._out(args, state)
        if out and error is not None and not isinstance(error, KeyboardInterrupt):
            out.write("error", state.global_step, error=f"{type(error).__name__}: {error}",
                      traceback="".join(traceback.format_exception(error)))


def reporting_callbacks(args) -> list[TrainerCallback]:
    """The sinks for ``args.report_to``; the events.jsonl log is always on."""
    return [EventLogCallback()]
