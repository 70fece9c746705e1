"""Schedule edits by name: ``decay_now``, ``extend``, ``rewarm``, ``scale_peak`` (issue 28).

Each is ``set(schedule={"op": ..., ...}, reason=...)``, the one live-edit command, so a local
Session, a client attached to a run and an agent all change the schedule the same way, and
the run checks and records it once (workbench/core/schedule_edits.py has the rule of each).
A mixin of every SessionLike that steers (the Session, the RemoteSession).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from workbench.core.schedule_edits import SCHEDULE_OPS, SCHEDULE_SHAPES, parse_schedule, schedule_label

__all__ = ["ScheduleSteering", "SCHEDULE_OPS", "SCHEDULE_SHAPES", "parse_schedule", "schedule_label", "edit_text"]


def edit_text(key: str, value: Any) -> str:
    """One edited value as the front-ends show it (a schedule change as a short phrase)."""
    if key == "schedule" and isinstance(value, Mapping):
        return schedule_label(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ScheduleSteering:
    """The schedule edits, named (mixed into a SessionLike that has ``set``)."""

    # The SessionLike's own set(reason=..., **changes), which every named change goes through;
    # declared, not defined, so the class it is mixed into provides it.
    set: Callable[..., Future | dict[str, Any]]

    def decay_now(self, steps: int, to: float | str = 0.0, shape: str = "linear",
                  reason: str | None = None) -> Future | dict[str, Any]:
        """Start the cooldown now: from the current rate (no jump) down to ``to`` (a rate, or
        "min_lr": where the schedule was heading) over ``steps`` steps along ``shape``
        ("linear" or "cosine"); the run ends with it (max_steps = now + steps)."""
        return self.set(schedule={"op": "decay_now", "steps": steps, "to": to, "shape": shape}, reason=reason)

    def extend(self, max_steps: int, reason: str | None = None) -> Future | dict[str, Any]:
        """Train until ``max_steps`` with the rest of the schedule stretched to it from the
        current step (its shape kept, no jump in the rate)."""
        return self.set(schedule={"op": "extend", "max_steps": max_steps}, reason=reason)

    def rewarm(self, steps: int, peak: float, shape: str = "cosine", reason: str | None = None,
               ) -> Future | dict[str, Any]:
        """A warm restart: up to ``peak`` over ``steps`` steps (0: a jump, asked for), then
        down along ``shape`` to where the schedule was heading by max_steps."""
        return self.set(schedule={"op": "rewarm", "steps": steps, "peak": peak, "shape": shape}, reason=reason)

    def scale_peak(self, factor: float, reason: str | None = None) -> Future | dict[str, Any]:
        """Scale the whole schedule, the current rate included (what ``lr_scale`` does)."""
        return self.set(schedule={"op": "scale_peak", "factor": factor}, reason=reason)
