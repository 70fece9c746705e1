"""A run's proposals: changes someone suggests, for a person to accept or reject (issue 28).

An autopilot in dry-run mode, or any client, ``propose``s a live edit to the run itself
(session/proposals.py keeps them, a few, bounded); the run publishes them in its snapshot,
so every front-end on it (the dashboard and the notebook panel in any process, ``workbench
ctl``) lists them, and whoever is attached ``decide``s: an accepted one is applied through
the run's ``set()`` as a live edit whose reason names the proposal (``accepted_reason``), a
rejected one is recorded. Both are events (``proposal``, ``proposal_decided``), so the
proposer hears the answer wherever it runs.

Plain values only, as the rest of the door: importing this module imports neither torch nor
a front-end library.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.core.edits import MAX_REASON
from workbench.core.schedule_edits import parse_schedule, schedule_label

__all__ = ["Proposal", "PROPOSAL_STATES", "DECIDED", "MAX_PENDING", "KEPT_DECIDED", "MAX_SOURCE",
           "describe_changes", "accepted_reason", "describe_proposal_event"]

# What became of a proposal. "pending": waiting for a person; "accepted": the run has the
# change queued for its next step end; "applied": the run made it (a live edit); "rejected":
# a person (or the proposer, withdrawing it) said no; "failed": the run refused the change.
PROPOSAL_STATES = ("pending", "accepted", "applied", "rejected", "failed")
DECIDED = frozenset(PROPOSAL_STATES[1:])
# How many proposals may wait at once: every snapshot carries them, and a proposer that
# never hears back must not grow the run's memory (or every poll) without bound.
MAX_PENDING = 32
KEPT_DECIDED = 16  # decided proposals kept (the newest), so front-ends show what became of them
MAX_SOURCE = 80  # characters of a proposer's name ("autopilot/plateau")


def describe_changes(changes: Mapping[str, Any]) -> str:
    """Changes as one short phrase (``lr_scale=0.5``, ``decay_now steps=200 ...``) for the
    decision log, the proposals' lists, the dashboard and the panel."""
    parts = []
    for key, value in changes.items():
        if key == "schedule":
            try:
                parts.append(schedule_label(parse_schedule(value)))
            except ValueError:
                parts.append(f"schedule={value!r}")
        else:
            parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value!r}")
    return ", ".join(parts) or "(nothing)"


def accepted_reason(proposal_id: int, source: str, reason: str | None, why: str | None = None) -> str:
    """The reason an accepted proposal's live edit is recorded with: ``accepted proposal 3
    from autopilot/plateau: eval_loss flat for 3 evaluations`` (and ``; WHY`` when the person
    who accepted it said why), one line, cut to the run's MAX_REASON."""
    text = f"accepted proposal {proposal_id} from {source}" + (f": {reason}" if reason else "")
    text = " ".join((text + (f"; {why}" if why else "")).split())
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


@dataclass(frozen=True)
class Proposal:
    """One change proposed to a run, and what became of it (plain data: it crosses the
    control protocol as JSON, ``to_dict``/``from_dict``)."""

    id: int
    source: str  # who proposes: "autopilot/plateau", "ctl", "python", ...
    changes: dict[str, Any]  # live edits as set() takes them (checked when proposed)
    reason: str | None
    step: int  # the run's step when it was proposed
    time: float = field(default_factory=time.time)
    state: str = "pending"
    decided_by: str | None = None  # who decided: a control client's name, "dashboard", "python", ...
    decision: str | None = None  # the decider's reason (why rejected; a note with the acceptance)
    decided_step: int | None = None
    decided_time: float | None = None
    note: str | None = None  # what the run applied, or the one line it refused the change with
    applied: dict[str, Any] | None = None  # set()'s answer once applied

    @property
    def pending(self) -> bool:
        """Whether it still waits for a person."""
        return self.state == "pending"

    @property
    def change_text(self) -> str:
        """The change as a short phrase (``lr_scale=0.5``)."""
        return describe_changes(self.changes)

    def line(self) -> str:
        """The proposal as one line, for ``workbench ctl`` and logs."""
        why = f": {self.reason}" if self.reason else ""
        fate = "" if self.pending else f" by {self.decided_by or '?'}" + (f" ({self.decision})" if self.decision else "")
        note = f" [{self.note}]" if self.state == "failed" and self.note else ""
        return f"{self.id} {self.state}{fate}{note}: step {self.step} {self.source}: {self.change_text}{why}"

    def to_dict(self) -> dict[str, Any]:
        """As a JSON-friendly dict (``from_dict`` reads it back)."""
        return {**asdict(self), "changes": dict(self.changes),
                "applied": dict(self.applied) if self.applied is not None else None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Proposal":
        """From ``to_dict``'s output (unknown keys ignored, so a newer run's reply still reads)."""
        known = cls.__dataclass_fields__
        fields = {k: v for k, v in data.items() if k in known}
        fields["changes"] = dict(fields.get("changes") or {})
        if fields.get("applied") is not None:
            fields["applied"] = dict(fields["applied"])
        return cls(**fields)


def describe_proposal_event(kind: str, step: int, data: Mapping[str, Any]) -> tuple[str, str]:
    """(level, text) of a ``proposal`` or ``proposal_decided`` event for the front-ends' event logs."""
    change = describe_changes(data.get("changes") or {})
    ident, source = data.get("id"), data.get("source", "?")
    if kind == "proposal":
        why = f": {data['reason']}" if data.get("reason") else ""
        return "warn", f"step {step}: proposal {ident} from {source}: {change}{why}"
    state = data.get("state", "?")
    by = f" by {data['by']}" if data.get("by") else ""
    why = f" ({data['decision']})" if data.get("decision") else ""
    extra = f": {data['note']}" if state == "failed" and data.get("note") else ""
    level = {"applied": "good", "failed": "error", "rejected": "info"}.get(str(state), "info")
    return level, f"step {step}: proposal {ident} ({change}) {state}{by}{why}{extra}"
