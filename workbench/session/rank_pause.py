"""Rank 0's pause with several processes: heartbeats keep the other ranks waiting.

A single process pauses by blocking its training thread; with several, rank 0 also has to
keep the others from sitting in a collective until it times out, and every rank must take
part in a save or evaluation asked for while paused. The rank agreement's heartbeat
(distributed/rank_sync.py) does both; this is the Session's side of it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from workbench.distributed.rank_sync import HEARTBEAT_S
from workbench.door.values import Status

if TYPE_CHECKING:
    from workbench.distributed.rank_sync import RankSync

__all__ = ["hold_ranks_paused"]

Session = Any  # annotations only: Session imports this module (directly or not), so it is not imported back


def hold_ranks_paused(session: "Session", sync: "RankSync") -> None:
    """Rank 0's pause: heartbeats keep the other ranks waiting with it and carry the
    saves and evaluations asked for meanwhile, which every rank runs together."""
    with session._lock:
        paused_at = time.perf_counter()
        announced = False
        session._blocked = True
        try:
            while True:
                wanted = session._pause_requested.is_set() and not session.trainer.stop_request.is_set()
                if wanted and not announced:
                    announced = True
                    session._set_status(Status.PAUSED)
                    session._emit("paused")
                    session._log_event("pause")
                kind, future = "", None
                if wanted and not session._paused_actions.empty():
                    kind, future = session._paused_actions.get_nowait()
                still, actions = sync.heartbeat(wanted, kind)
                for action in actions:
                    try:
                        result = session._save_now() if action == "save" else session._evaluate_now()
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        if future is not None:
                            future.set_exception(exc)
                        raise
                    if future is not None and action == kind:
                        future.set_result(result)
                        future = None
                if not still:
                    break
                if session._paused_actions.empty():
                    session._unpaused.wait(HEARTBEAT_S)
        finally:
            session._blocked = False
            sync.paused = False
            while not session._paused_actions.empty():  # asked for just as the pause ended
                kind, future = session._paused_actions.get_nowait()
                session._requeue(kind, future)
        if session._started_at is not None:
            session._started_at += time.perf_counter() - paused_at
        if session._status == Status.PAUSED:
            session._set_status(Status.RUNNING)
