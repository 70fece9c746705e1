"""A run's event stream: a bounded history read by cursor, and live subscriber queues.

Kept apart from the Session's thread and commands. Emitting never blocks the training
thread: a subscriber that falls behind loses its oldest event, and a reader polling with
a cursor older than the history gets what is left.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time

from workbench.door.values import SessionEvent

__all__ = ["EventHub", "EVENT_HISTORY"]

EVENT_HISTORY = 2000  # events kept for events_since() readers


class EventHub:
    """Every SessionEvent of a run, for pollers (``since``) and subscribers (``subscribe``)."""

    def __init__(self, history: int = EVENT_HISTORY) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[queue.Queue] = []
        self._history: collections.deque[SessionEvent] = collections.deque(maxlen=history)
        self._emitted = 0  # events emitted so far: the cursor since() hands out

    def emit(self, kind: str, step: int, **data: object) -> SessionEvent:
        """Record an event and hand it to every subscriber; returns it."""
        event = SessionEvent(kind=kind, step=step, time=time.time(), data=data)
        with self._lock:
            subscribers = list(self._subscribers)
            self._history.append(event)
            self._emitted += 1
        for q in subscribers:
            try:
                q.put_nowait(event)
            except queue.Full:  # a slow consumer loses its oldest event, never blocks training
                try:
                    q.get_nowait()
                    q.put_nowait(event)
                except (queue.Empty, queue.Full):
                    pass
        return event

    def since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        """The events after ``cursor`` and the cursor to pass next time (0: from the start)."""
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"cursor: expected 0 or a cursor events_since() returned, got {cursor!r}")
        with self._lock:
            total = self._emitted
            if cursor > total:
                raise ValueError(f"cursor: {cursor} is ahead of this session's {total} events; pass 0 or a "
                                 "cursor this session's events_since() returned")
            oldest = total - len(self._history)
            return list(itertools.islice(self._history, max(cursor - oldest, 0), None)), total

    def subscribe(self, maxsize: int = 10_000) -> queue.Queue:
        """A queue receiving every event from now on (oldest dropped when full)."""
        q: queue.Queue = queue.Queue(maxsize=maxsize)
        with self._lock:
            self._subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        """Stop delivering events to ``q``."""
        with self._lock:
            if q in self._subscribers:
                self._subscribers.remove(q)
