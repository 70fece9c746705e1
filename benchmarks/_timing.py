"""Timing helpers shared by the benchmark scripts (not part of the workbench package).

* :class:`Stopwatch` times one run two ways: the whole call (set-up and tear-down
  included) and the training loop alone (``begin()``/``end()``, called from the loop's
  first and last hooks), so per-step throughput is not blurred by fixed costs.
* :func:`watch_session` runs a workbench ``Session`` while a front-end-like consumer reads
  ``snapshot()`` ten times a second, as the dashboard and the notebook panel do.
* :func:`round_robin` runs every row once per repetition, rotating which row goes first,
  so drift in the machine's load hits every row alike.
* :func:`print_table` prints medians (with the spread) and the ratio to a baseline row.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Stopwatch", "watch_session", "round_robin", "print_table"]


class Stopwatch:
    """Wall and process-CPU seconds of a whole call (``with``) and of its loop (begin/end)."""

    def __init__(self) -> None:
        self.call = self.loop = self.loop_cpu = 0.0
        self._call_start = self._loop_start = self._loop_cpu_start = None

    def __enter__(self) -> "Stopwatch":
        self._call_start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.call = time.perf_counter() - self._call_start

    def begin(self) -> None:
        """The training loop starts (the first step is about to run)."""
        self._loop_cpu_start = time.process_time()
        self._loop_start = time.perf_counter()

    def end(self) -> None:
        """The training loop is over (the last step has run)."""
        self.loop = time.perf_counter() - self._loop_start
        self.loop_cpu = time.process_time() - self._loop_cpu_start

    @property
    def fixed(self) -> float:
        """Seconds of the call spent outside the loop (set-up and tear-down)."""
        return max(self.call - self.loop, 0.0)


def watch_session(session: Any, every: float = 0.1) -> tuple[str, int]:
    """Start ``session``, read a snapshot every ``every`` seconds until it ends.

    Returns ``(status, polls)``. What is read is what a front-end shows on each refresh:
    status, step, throughput, the latest loss and the memory summary.
    """
    done = threading.Event()
    seen: list[tuple] = []

    def consumer() -> None:
        while not done.wait(every):
            snap = session.snapshot()
            seen.append((snap.status, snap.step, snap.steps_per_second, snap.latest("loss"),
                         snap.memory.parameters if snap.memory is not None else None))

    poller = threading.Thread(target=consumer, name="benchmark-poller", daemon=True)
    poller.start()
    try:
        session.start()
        status = session.wait()
    finally:
        done.set()
        poller.join()
    return status, len(seen)


def round_robin(runners: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Call every runner once per repetition; repetition i starts at row i (mod rows)."""
    names = list(runners)
    results: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(repeats):
        k = i % len(names) if names else 0
        for name in names[k:] + names[:k]:
            results[name].append(runners[name]())
    return results


def print_table(title: str, rates: dict[str, list[float] | str], baseline: str,
                extra: dict[str, dict[str, str]] | None = None) -> None:
    """One row per runner: median steps/s, min, max, ratio to ``baseline``, µs per step.

    A row whose value is a string (e.g. "not installed") prints that string instead.
    ``extra`` adds columns: {column title: {row name: text}}.
    """
    extra = extra or {}
    base = rates.get(baseline)
    base_med = statistics.median(base) if isinstance(base, list) and base else None
    width = max([len(name) for name in rates] + [20])
    head = f"{'runner':<{width}} {'steps/s':>9} {'min':>8} {'max':>8} {'ratio':>7} {'µs/step':>9}"
    head += "".join(f" {col:>{max(len(col), 8)}}" for col in extra)
    print(title)
    print(head)
    for name, values in rates.items():
        if isinstance(values, str):
            print(f"{name:<{width}} {values}")
            continue
        med = statistics.median(values)
        ratio = f"{med / base_med:>7.3f}" if base_med else f"{'-':>7}"
        line = f"{name:<{width}} {med:>9.1f} {min(values):>8.1f} {max(values):>8.1f} {ratio} {1e6 / med:>9.0f}"
        line += "".join(f" {cells.get(name, '-'):>{max(len(col), 8)}}" for col, cells in extra.items())
        print(line)
