"""The one stop request of a run: signals, Ctrl-C, the dashboard, a remote ``stop`` and the
guard all set it, and the loop's stop gate turns it into a checkpoint and a stop at the next
safe point. It remembers why it was set (the first reason wins) and whether to save."""

from __future__ import annotations

import threading
import time

__all__ = ["StopRequest"]


class StopRequest:
    """A thread-safe "stop and save" flag that remembers why it was set (first reason wins)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.save = True
        self.set_at: float | None = None  # time.monotonic() of the request

    def set(self, reason: str, save: bool = True) -> bool:
        """Request a stop; returns False when one was already requested (nothing changes)."""
        with self._lock:
            if self._event.is_set():
                return False
            self.reason, self.save = reason, save
            self.set_at = time.monotonic()
            self._event.set()
            return True

    def is_set(self) -> bool:
        """Whether a stop was requested."""
        return self._event.is_set()

    def clear(self) -> None:
        """Forget a request (a new run in the same process)."""
        with self._lock:
            self._event.clear()
            self.reason = None
            self.save = True
            self.set_at = None
