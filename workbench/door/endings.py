"""How a run ended, in words: the one place the CLI, the dashboard, ``watch``, ``attach`` and
``ctl`` take them from, so a run stopped from ``workbench ctl`` reads the same everywhere.

A run records its end as plain values (events.jsonl's ``end`` record, the Session's last
``finished`` event): a status, the stop reason (who asked: a signal, a front-end, the
guard), whether the stop saved, the step. The reason is a short code because it crosses
processes and ranks (distributed/rank_sync.py encodes it); this module turns it into what a
person reads. Importing it imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CLIENTS", "STOPPED_BY", "stopped_by", "describe_end", "describe_end_record", "describe_guard_stop",
           "describe_dashboard_failure"]

# The clients of a run's control endpoint, by the name each gives in its hello: the run's
# own console says what each did ("paused from workbench ctl at step 40"), and a stop from
# one carries its name as the stop reason.
CLIENTS = {
    "ctl": "workbench ctl",
    "attach": "an attached dashboard (workbench attach)",
    "remote": "a script over the control endpoint (workbench.attach)",
}

# Who asked for a stop, by the code a stop request carries (Session.stop's ``reason``).
STOPPED_BY = {
    **{name: f"from {who}" for name, who in CLIENTS.items()},
    "dashboard": "from the dashboard",
    "notebook": "from the notebook panel",
    "session": "from Python (session.stop())",
    "guard": "by the guard",
    "resume_from": "to resume from a checkpoint",
    "branch": "to branch from a checkpoint",
    "SIGTERM": "by SIGTERM",
    "SIGHUP": "by SIGHUP (the terminal closed)",
    "SIGINT": "by Ctrl-C",
    "SIGUSR1": "by SIGUSR1",
    "ui": "from the dashboard",
}


def stopped_by(reason: str | None) -> str:
    """``"stopped from workbench ctl"`` for a stop reason code; ``"stopped"`` when none is known.

    An unknown code (a newer run's) is shown as it is rather than dropped."""
    if not reason:
        return "stopped"
    return f"stopped {STOPPED_BY.get(reason, f'by {reason}')}"


def describe_end(status: str | None, stop_reason: str | None = None, step: int | str | None = None,
                 saved: bool | None = True, where: str | None = None, detail: str | None = None) -> str:
    """One line on how a run ended: ``finished at step 300``, ``stopped from workbench ctl at
    step 40, checkpoint saved``, ``stopped from the dashboard at step 12, not saved``,
    ``failed at step 3``. With ``where`` (an output_dir): ``...; checkpoint saved in runs/x``,
    ``... without saving``, ``finished at step 300; files in runs/x``.

    ``status`` is the recorded one (finished, stopped, failed); a run that stopped before
    its last step with no reason recorded (an early-stopping callback) is "stopped".
    ``saved`` None: whether the stop saved is not known, and not said. ``detail``: what is
    known of why, said right after the step (the guard's interventions)."""
    at = (f" at step {step}" if step is not None else "") + (f" {detail}" if detail else "")
    status = str(status or "ended")
    if status == "failed":
        return f"failed{at}" + (f"; see {where}" if where else "")
    if status == "stopped" or stop_reason:
        text = stopped_by(stop_reason) + at
        if saved is None:  # not known (a dashboard's summary): said nowhere rather than guessed
            return text + (f"; files in {where}" if where else "")
        if saved is False:
            return text + (" without saving" if where else ", not saved")
        return text + (f"; checkpoint saved in {where}" if where else ", checkpoint saved")
    return f"{status}{at}" + (f"; files in {where}" if where else "")


def describe_end_record(record: Mapping[str, Any], where: str | None = None) -> str:
    """describe_end() of an ``end`` / ``error`` record or a ``finished`` event's data (status,
    stop_reason, saved, step), with the exit code ``workbench run`` gave it when known."""
    status = record.get("status")
    if status is None:  # a live Session's "finished" event says stopped=True/False
        status = "stopped" if record.get("stopped") else "finished"
    text = describe_end(status, record.get("stop_reason"), record.get("step"), record.get("saved", True), where)
    code = record.get("exit_code")
    return text + (f" (exit code {code})" if code is not None else "")


def describe_guard_stop(step: int, interventions: int, stuck: str | None = None, events: str | None = None,
                        where: str | None = None) -> str:
    """How a run the guard stopped ended, with what a person needs to see why: ``stopped by
    the guard at step 40 after 3 interventions (no progress: ...; guard events in
    runs/x/events.jsonl); checkpoint saved in runs/x``. The guard always stops with a
    checkpoint (a headless run cannot wait for someone to resume its pause)."""
    why = "; ".join(part for part in (f"no progress: {stuck}" if stuck else None,
                                      f"guard events in {events}" if events else None) if part)
    detail = f"after {interventions} interventions" + (f" ({why})" if why else "")
    return describe_end("stopped", "guard", step, True, where, detail=detail)


def describe_dashboard_failure(status: str | None, stop_reason: str | None, step: int | str | None,
                               saved: bool | None, where: str | None = None) -> str:
    """The CLI's line when the dashboard itself failed and the run was ended under it (or had
    ended already): ``the dashboard failed; the run stopped from the dashboard at step 12;
    checkpoint saved in runs/x``. The run's own end is said in describe_end's words."""
    return f"the dashboard failed; the run {describe_end(status, stop_reason, step, saved, where)}"
