"""Messages that carry news from background threads to the app's event loop.

Textual widgets are not thread-safe. Threads (the event forwarder, command workers) only
ever *post* these messages (``post_message`` is thread-safe); the handlers run on the
app's loop, where touching widgets is allowed.
"""

from __future__ import annotations

from typing import Any

from textual.message import Message

from workbench.door.protocol import SessionEvent, SessionLike

__all__ = ["SessionEventsArrived", "CommandFinished", "RunReplaced", "LogRecordArrived"]


class SessionEventsArrived(Message):
    """``SessionEvent``s, oldest first, from the session of generation ``generation``.

    One message for all the events a poll found: a run logging every step emits hundreds a
    second, and a message each woke the app's loop for every one of them."""

    def __init__(self, events: list[SessionEvent], generation: int) -> None:
        super().__init__()
        self.events = events
        self.generation = generation


class CommandFinished(Message):
    """A command that ran off the UI thread ended: ``error`` is None on success."""

    def __init__(self, what: str, result: Any = None, error: BaseException | None = None) -> None:
        super().__init__()
        self.what = what
        self.result = result
        self.error = error


class RunReplaced(Message):
    """The dashboard now follows ``session`` (after a resume-from or a branch).

    ``branch``: a new run that took the old one's process over; one branch can be told
    twice (by the form that made it and by the poll that sees the old run's successor)."""

    def __init__(self, session: SessionLike, note: str, branch: bool = False) -> None:
        super().__init__()
        self.session = session
        self.note = note
        self.branch = branch


class LogRecordArrived(Message):
    """A warning or error logged by the core (the ``workbench`` logger) or by ``warnings``."""

    def __init__(self, level: str, text: str) -> None:
        super().__init__()
        self.level = level
        self.text = text
