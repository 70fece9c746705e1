"""The event bridge: a thread that moves SessionEvents from the session to the app.

The session keeps its recent events and hands them out with ``events_since(cursor)``, a
plain poll that also works for a session in another process. Polling from the app's event
loop would stall it whenever the session is slow to answer, so a small daemon thread polls
instead and posts the events each poll found to the app in one ``post_message``
(thread-safe). The training thread itself never touches the app.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from workbench.door.protocol import SessionLike

from .messages import LogRecordArrived, SessionEventsArrived

__all__ = ["EventBridge", "LogForwarder"]

POLL_S = 0.1  # how often the bridge asks for new events: quick enough to read as live


class EventBridge:
    """Forward one session's events to ``app`` until ``close()``, from its first event on
    (so the start and an eval_on_start evaluation are shown even if the bridge starts late)."""

    def __init__(self, app: Any, session: SessionLike, generation: int) -> None:
        self.app = app
        self.session = session
        self.generation = generation
        self.cursor = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start forwarding (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._forward, name="workbench-tui-events", daemon=True)
            self._thread.start()

    def _forward(self) -> None:
        failed = None  # the last failure, said once: a bad reply never ends the bridge
        while not self._closed.is_set():
            try:
                events, self.cursor = self.session.events_since(self.cursor)
            except Exception as exc:  # noqa: BLE001 - shown in the event log, then tried again
                text = f"the run's events could not be read: {type(exc).__name__}: {exc}"
                if text != failed:
                    failed = text
                    self.app.post_message(LogRecordArrived("error", text))
                self._closed.wait(1.0)
                continue
            failed = None
            if events:
                self.app.post_message(SessionEventsArrived(events, self.generation))
            self._closed.wait(POLL_S)

    def close(self) -> None:
        """Stop forwarding."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


class LogForwarder(logging.Handler):
    """Show the core's warnings in the event log instead of printing them over the screen.

    While the app owns the terminal, a line written to stderr would tear the display; so
    this handler is attached to the ``workbench``, ``transformers`` (the warnings HF's Trainer
    gives come out there) and ``py.warnings`` loggers (with Python warnings routed to logging)
    for the app's lifetime, and the terminal handlers transformers puts on its logger are
    detached meanwhile. ``emit`` may run on the training thread: it only posts a message.
    """

    LOGGERS = ("workbench", "transformers", "py.warnings")

    def __init__(self, app: Any) -> None:
        super().__init__(level=logging.WARNING)
        self.app = app
        self._saved: list[tuple[logging.Logger, bool, list[logging.Handler]]] = []

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
            terminal = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
                        and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)]
            self._saved.append((logger, logger.propagate, terminal))
            for handler in terminal:
                logger.removeHandler(handler)
            logger.addHandler(self)
            logger.propagate = False  # the root logger's handlers would print to the terminal

    def uninstall(self) -> None:
        """Detach and restore what ``install`` changed."""
        for logger, propagate, terminal in self._saved:
            logger.removeHandler(self)
            for handler in terminal:
                logger.addHandler(handler)
            logger.propagate = propagate
        self._saved.clear()
        logging.captureWarnings(False)
