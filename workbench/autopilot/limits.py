"""The autopilot's limits: which live edits it may make, within which ranges, how often.

A policy (a rule, or a language model behind a function) only *asks*; the limits decide.
Every change is checked here before it is sent, and a change outside them is refused with
one line and never reaches the run, so a policy cannot act outside the schema however it
was written. The run then checks the edit again by its own rule (core/edits.py), as it
checks every client's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.core.edits import EDITABLE
from workbench.core.schedule_edits import SCHEDULE_OPS, parse_schedule
from workbench.door.proposals import describe_changes  # noqa: F401 - part of this module's API (the door has the one copy)

__all__ = ["Action", "Limits", "Range", "describe_changes"]

Range = tuple[float, float]
# The numbers resolving a schedule change adds (core/schedule_edits.py): the run's to fill in.
_RESOLVED = ("at", "from_ratio", "to_ratio", "peak_ratio", "end_ratio", "old_max_steps", "new_max_steps")


@dataclass(frozen=True)
class Action:
    """A change a policy asks for: live edits as ``set()`` takes them, and why (one line).

    ``changes``: ``{"lr_scale": 0.5}``, ``{"learning_rate": 3e-4}``, or a schedule change
    ``{"schedule": {"op": "decay_now", "steps": 200, "to": "min_lr"}}``."""

    changes: Mapping[str, Any]
    reason: str


def _range(name: str, value: Any) -> Range:
    """A (low, high) pair of finite numbers, low <= high."""
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in value))
    if not ok or value[0] > value[1]:
        raise ValueError(f"limits: {name}: expected a range (low, high) of numbers, low <= high, got {value!r}")
    return float(value[0]), float(value[1])


def _in(value: Any, bounds: Range) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and bounds[0] <= value <= bounds[1])


@dataclass(frozen=True)
class Limits:
    """The action schema: what the autopilot may change, in which ranges, and how often.

    ``allow`` maps a live-edit key (``learning_rate``, ``lr_scale``, ``max_steps``,
    ``eval_steps``, ...) to its range ``(low, high)``, or a schedule change (``decay_now``,
    ``extend``, ``rewarm``, ``scale_peak``) to the ranges of its numeric arguments (``{"steps":
    (50, 500)}``; an argument not named keeps only the run's own check). Anything not in
    ``allow`` is refused. ``max_changes`` changes at most per ``per_steps`` training steps
    (reverts of the autopilot's own changes are not counted: undoing is always allowed).

        Limits({"lr_scale": (0.25, 1.0), "decay_now": {"steps": (50, 500)}}, max_changes=2, per_steps=200)
    """

    allow: Mapping[str, Any]
    max_changes: int = 1
    per_steps: int = 100
    _ranges: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.allow, Mapping) or not self.allow:
            raise ValueError("limits: allow: name at least one key the autopilot may change, e.g. "
                             "{'lr_scale': (0.25, 1.0)}")
        for key, spec in self.allow.items():
            if key in SCHEDULE_OPS:
                if not isinstance(spec, Mapping):
                    raise ValueError(f"limits: {key}: expected the ranges of its arguments, e.g. {{'steps': (50, 500)}}")
                self._ranges[key] = {arg: _range(f"{key}.{arg}", r) for arg, r in spec.items()}
            elif key in EDITABLE and key != "schedule":
                self._ranges[key] = _range(key, spec)
            else:
                raise ValueError(f"limits: {key!r} is not a live edit or a schedule change; one of "
                                 f"{', '.join([*(k for k in EDITABLE if k != 'schedule'), *SCHEDULE_OPS])}")
        for name in ("max_changes", "per_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits: {name}: expected a whole number >= 1, got {value!r}")

    def check(self, changes: Mapping[str, Any]) -> str | None:
        """Why ``changes`` are outside the schema (one line), or None when they are within it."""
        if not isinstance(changes, Mapping) or not changes:
            return "refused: no change given"
        for key, value in changes.items():
            if key == "schedule":
                problem = self._check_schedule(value)
                if problem:
                    return problem
                continue
            if key not in self._ranges or key in SCHEDULE_OPS:
                return f"refused: {key} is not allowed (allowed: {self.allowed()})"
            low, high = self._ranges[key]
            if not _in(value, (low, high)):
                return f"refused: {key}={value!r} is outside its range [{low:g}, {high:g}]"
        return None

    def _check_schedule(self, value: Any) -> str | None:
        try:
            change = parse_schedule(value)
        except ValueError as exc:
            return f"refused: {exc}"
        op = change["op"]
        if op not in self._ranges:
            return f"refused: schedule {op} is not allowed (allowed: {self.allowed()})"
        given = value if isinstance(value, Mapping) else change
        if any(key in given for key in _RESOLVED):
            return "refused: a schedule change's resolved numbers are the run's to fill in"
        for arg, (low, high) in self._ranges[op].items():
            if arg in change and isinstance(change[arg], (int, float)) and not _in(change[arg], (low, high)):
                return f"refused: {op} {arg}={change[arg]!r} is outside its range [{low:g}, {high:g}]"
        return None

    def check_rate(self, step: int, recent: Sequence[int]) -> str | None:
        """Why one more change at ``step`` is too many (one line), given the steps of the
        changes already made (``recent``), or None when it is allowed."""
        window = [s for s in recent if s > step - self.per_steps]
        if len(window) < self.max_changes:
            return None
        next_step = sorted(window)[len(window) - self.max_changes] + self.per_steps
        return (f"refused: {len(window)} change(s) in the last {self.per_steps} steps (at most {self.max_changes}); "
                f"the next is allowed at step {next_step}")

    def allowed(self) -> str:
        """The allowed keys and ranges, as one line (for refusals, the UI and a model's prompt)."""
        parts = []
        for key, spec in self._ranges.items():
            if key in SCHEDULE_OPS:
                args = " ".join(f"{a} in [{lo:g}, {hi:g}]" for a, (lo, hi) in spec.items())
                parts.append(f"schedule {key}" + (f" ({args})" if args else ""))
            else:
                parts.append(f"{key} in [{spec[0]:g}, {spec[1]:g}]")
        return "; ".join(parts)

    def describe(self) -> str:
        """The whole schema as one line."""
        return f"{self.allowed()}; at most {self.max_changes} change(s) per {self.per_steps} steps"
