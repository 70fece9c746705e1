"""The terminal dashboard: ``workbench run CONFIG`` on a TTY, or ``DashboardApp(session).run()``.

Importing this package imports Textual; the core (``workbench.*``) never does.
"""

from __future__ import annotations

from typing import Any

from workbench.door.protocol import ENDED, SessionLike, Status

from .app import OUTCOMES, DashboardApp

__all__ = ["DashboardApp", "OUTCOMES", "run_dashboard"]


def run_dashboard(session: SessionLike, *, handle_signals: bool = True, attached: bool = False,
                  read_only: bool = False, autopilot: Any = None) -> str:
    """Open the dashboard on ``session`` (started if idle) and return its outcome when the user quits.

    ``attached``: the run lives elsewhere (``workbench attach``): q detaches, leaving it running.
    ``read_only``: ``workbench watch``: no steering key is offered, q leaves.
    ``autopilot``: an Autopilot (workbench.autopilot) steering the run from this process: its
    decisions are logged, and o shows them with its proposals to accept or reject (without one,
    o lists the proposals published to the run by anyone, once it has one).
    The outcome is one of ``OUTCOMES``; the CLI gives each its exit code (0 finished or
    saved, 130 stopped or interrupted, 143 SIGTERM, 1 failed or crashed).
    """
    app = DashboardApp(session, handle_signals=handle_signals, attached=attached, read_only=read_only,
                       autopilot=autopilot)
    outcome = app.run()
    if outcome is None and attached:
        return "crashed"  # a dashboard on a run elsewhere never stops it on its own failure
    if outcome is None:
        # The app itself crashed (Textual has printed why): keep the work, stop the run.
        if session.status not in ENDED and session.status != Status.IDLE:
            session.stop(save=True, reason="dashboard")
        return "crashed"
    return outcome
