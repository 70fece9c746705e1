"""Polling with a deadline: every wait in the suite ends, so a deadlock fails its test
instead of hanging the run, and no assertion depends on how fast a shared CPU is."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE = 120.0  # seconds; only reached when something is broken (the CPU is shared with other work)


def wait_until(condition: Callable[[], T], what: str, timeout: float = DEADLINE, every: float = 0.005) -> T:
    """Poll ``condition`` until it returns something truthy and return that, or fail naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def poll_until(condition: Callable[[], object], timeout: float, every: float = 0.05) -> bool:
    """Whether ``condition`` turns true within ``timeout`` seconds; no failure when it does not
    (for a test that asserts something does *not* happen, or checks it some other way)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
