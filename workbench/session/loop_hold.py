"""Reading the model from another thread (inspect, sample) without stalling the training loop.

The Session's lock is the one its training thread takes to publish a snapshot (several times
a second) and to leave a pause. Holding it keeps a paused loop at its step boundary, which
is what a consistent reading needs; holding it while the loop trains stalls training for
as long as the reading takes (a 20,000-token sample held a run 17 s without a step). So:

- while the loop is held (paused, not started, ended), the reading runs under the lock: the
  loop cannot leave the boundary until it is done (a resume or stop waits for it; a sample
  is capped, see session/inspection.py);
- while the loop trains, ``inspect`` reads without the lock (a live reading: it never
  blocks a step, its numbers may straddle one), and ``sample`` is refused with one line:
  it switches the model to eval mode and draws from the RNG the loop uses, so it would
  change the run it samples from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from workbench.door.callers import for_caller
from workbench.door.values import LOOP_HELD

__all__ = ["reading_the_model"]

Session = Any  # annotations only: Session imports this module


@contextlib.contextmanager
def reading_the_model(session: "Session", what: str, live_ok: bool) -> Iterator[None]:
    """Hold the loop at its boundary for the body when it is held already; otherwise run the
    body without touching the lock (``live_ok``) or refuse with RuntimeError saying to pause first."""
    status = session._status  # read without the lock: a training loop never waits for this
    if status in LOOP_HELD:
        lock = session._lock
        with lock:
            if session._status in LOOP_HELD:  # still held, and now it cannot leave until the body ends
                yield
                return
            status = session._status
    if not live_ok:
        # Said the way the caller can act: Python, or a person at a dashboard or a command line
        # (an attached dashboard's inspect screen reaches this through the control server).
        out = session.trainer.args.output_dir
        how = for_caller("session.pause(wait=True)", f"p in the dashboard, or workbench ctl {out} pause --wait")
        raise RuntimeError(f"{what}: the run is {status}; pause it first ({how}): {what} reads the model "
                           "between steps only")
    yield
