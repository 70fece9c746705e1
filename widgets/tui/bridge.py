"""The event bridge: a thread that moves SessionEvents from the session's queue to the app.

The session delivers events into a ``queue.Queue`` from the training thread. Waiting on
that queue would block the app's event loop, so a small daemon thread waits instead and
posts each event to the app with ``post_message`` (thread-safe). The training thread
itself never touches the app: if the app is slow, only this queue grows (and the session
drops the oldest events rather than block training).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from .messages import LogRecordArrived, SessionEventArrived

__all__ = ["EventBridge", "LogForwarder"]


class EventBridge:
    """Forward one session's events to ``app`` until ``close()``.

    ``subscribe()`` happens in the constructor, before the session starts, so the first
    events (the start, the eval_on_start evaluation) are not missed.
    """

    def __init__(self, app: Any, session: Any, generation: int) -> None:
        self.app = app
        self.session = session
        self.generation = generation
        self.queue: queue.Queue = session.subscribe()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start forwarding (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._forward, name="workbench-tui-events", daemon=True)
            self._thread.start()

    def _forward(self) -> None:
        while not self._closed.is_set():
            try:
                event = self.queue.get(timeout=0.2)  # the timeout only bounds how long close() waits
            except queue.Empty:
                continue
            self.app.post_message(SessionEventArrived(event, self.generation))

    def close(self) -> None:
        """Stop forwarding and unsubscribe from the session."""
        self._closed.set()
        self.session.unsubscribe(self.queue)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


class LogForwarder(logging.Handler):
    """Show the core's warnings in the event log instead of printing them over the screen.

    While the app owns the terminal, a line written to stderr would tear the display; so
    this handler is attached to the ``workbench`` and ``py.warnings`` loggers (with Python
    warnings routed to logging) for the app's lifetime. ``emit`` may run on the training
    thread: it only posts a message.
    """

    LOGGERS = ("workbench", "py.warnings")

    def __init__(self, app: Any) -> None:
        super().__init__(level=logging.WARNING)
        self.app = app
        self._saved: list[tuple[logging.Logger, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = record.getMessage().strip().splitlines()
        except Exception:  # noqa: BLE001 - a malformed log call must not break the UI
            lines = [str(record.msg)]
        level = "error" if record.levelno >= logging.ERROR else "warn"
        self.app.post_message(LogRecordArrived(level, lines[0] if lines else record.name))

    def install(self) -> None:
        """Attach to the loggers and route ``warnings.warn`` to logging."""
        logging.captureWarnings(True)
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.propagate))
            logger.addHandler(self)
            logger.propagate = False  # the root logger's handlers would print to the terminal

    def uninstall(self) -> None:
        """Detach and restore what ``install`` changed."""
        for logger, propagate in self._saved:
            logger.removeHandler(self)
            logger.propagate = propagate
        self._saved.clear()
        logging.captureWarnings(False)
