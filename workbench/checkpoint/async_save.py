"""Checkpoint writes in the background: the step only pays for copying state to host memory.

One writer thread, one save at a time: a new save first waits for the one before (so
checkpoints publish in step order and at most one extra host copy exists). The publish
itself stays atomic (temporary folder, manifest, rename), so a crash mid-write leaves no
complete-looking checkpoint. A failed write is raised at the next save or at ``wait()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["CheckpointWriter"]


class CheckpointWriter:
    """Runs checkpoint writes on a background thread, one at a time."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> Future | None:
        """The write in progress (or last finished), None before the first."""
        return self._pending

    def submit(self, write: Callable[[], Any]) -> Future:
        """Wait for the previous write (re-raising its error), then start ``write`` in the background."""
        self.wait()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-save")
            self._pending = self._executor.submit(write)
            return self._pending

    def wait(self) -> Any:
        """Block until the last write has finished; re-raise its error once."""
        pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result()
        finally:
            if pending.done() and pending.exception() is not None:
                self._pending = None  # reported once; the next save starts clean

    def close(self) -> None:
        """Finish the pending write and stop the thread."""
        try:
            self.wait()
        finally:
            with self._lock:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
