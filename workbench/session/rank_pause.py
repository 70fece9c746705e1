"""Rank 0's pause with several processes: heartbeats keep the other ranks waiting.

A single process pauses by blocking its training thread; with several, rank 0 also has to
keep the others from sitting in a collective until it times out, and every rank must take
part in a save, an evaluation or a fork (its variants, keep, discard) asked for while paused. The rank agreement's heartbeat
(distributed/rank_sync.py) does both; this is the Session's side of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.distributed.rank_sync import FORK_ACTIONS, HEARTBEAT_S
from workbench.door.values import Status

if TYPE_CHECKING:
    from workbench.distributed.rank_sync import RankSync

__all__ = ["hold_ranks_paused"]

Session = Any  # annotations only: Session imports this module (directly or not), so it is not imported back


def hold_ranks_paused(session: "Session", sync: "RankSync") -> None:
    """Rank 0's pause: heartbeats keep the other ranks waiting with it and carry the
    saves and evaluations asked for meanwhile, which every rank runs together."""
    with session._lock:
        session._pause_clock.begin()  # paused time is not training time (progress.py)
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
                kind, future, order = "", None, None
                if wanted and not session._paused_actions.empty():
                    kind, future, order = session._paused_actions.get_nowait()
                still, actions = sync.heartbeat(wanted, kind, order)
                for action in actions:
                    try:
                        result = _run(session, action, order if action == kind else None)
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
                    session._publish_locked()  # the paused time shown keeps counting (progress.py)
        finally:
            session._blocked = False
            sync.paused = False
            while not session._paused_actions.empty():  # asked for just as the pause ended
                kind, future, _order = session._paused_actions.get_nowait()
                if kind in FORK_ACTIONS:  # a fork's steps start from a pause only
                    future.set_exception(RuntimeError(f"{kind}: the run resumed before it ran; pause and ask again"))
                else:
                    session._requeue(kind, future)
        session._pause_clock.end()
        if session._status == Status.PAUSED:
            session._set_status(Status.RUNNING)


def _run(session: "Session", action: str, order: dict[str, Any] | None) -> Any:
    """Rank 0's part of an action every rank runs together (the others: RankSync.follow_pause)."""
    if action == "save":
        return session._save_now()
    if action == "evaluate":
        return session._evaluate_now()
    return {"fork": session._fork_now, "keep": session._keep_now, "discard": session._discard_now,
            "save_variant": session._save_variant_now}[action](order)
