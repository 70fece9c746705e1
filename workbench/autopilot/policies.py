"""The autopilot's policies: what to change, and why, from what a run shows.

A policy sees what any front-end sees (the new events and the newest snapshot, as an
:class:`Observation`) and returns an :class:`~workbench.autopilot.limits.Action` or None.
It changes nothing itself: the Autopilot checks the action against the limits and sends it
(or, in dry-run mode, proposes it). Two built-in policies:

- :class:`PlateauPolicy`: when the watched evaluation metric has not improved for
  ``patience`` evaluations, halve the learning rate (``lr_scale``) or start the decay
  (``decay_now``, once: the run then ends with the cooldown);
- :class:`SpikePolicy`: after the guard's interventions (non-finite or spiking steps), a
  cooldown: the rate scaled down, and back up once ``calm_steps`` steps pass without one.

Anything with a ``name`` and an ``observe(Observation)`` method is a policy (an LLM behind a
function too: examples/agent_llm_policy.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from workbench.autopilot.limits import Action, Limits
from workbench.door.values import SessionEvent, Snapshot

__all__ = ["Observation", "Policy", "PlateauPolicy", "SpikePolicy", "metric_values"]


@dataclass(frozen=True)
class Observation:
    """What a policy sees at one poll: the run's step, the events since the last poll, the
    newest snapshot, and the limits its actions are checked against (a model's prompt can
    quote them)."""

    step: int
    events: tuple[SessionEvent, ...]
    snapshot: Snapshot
    limits: Limits


@runtime_checkable
class Policy(Protocol):
    """A policy: ``observe`` returns the change it asks for at this poll, or None.

    Optional: ``declined(action, note)``, called when an action was refused by the limits,
    rejected by a person or refused by the run, so a policy that keeps state can undo it."""

    name: str

    def observe(self, seen: Observation) -> Action | None:
        """The change to ask for now (None: none)."""
        ...


def metric_values(events: tuple[SessionEvent, ...], metric: str) -> list[tuple[int, float]]:
    """The (step, value) of ``metric`` in the ``evaluated`` events among ``events``."""
    found = []
    for event in events:
        if event.kind == "evaluated" and metric in event.data:
            try:
                value = float(event.data[metric])
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                found.append((event.step, value))
    return found


def _decaying(snapshot: Snapshot) -> bool:
    """Whether the run's edits already hold a ``decay_now`` (the cooldown is under way)."""
    for edit in snapshot.edits:
        change = edit.get("schedule")
        if isinstance(change, Mapping) and change.get("op") == "decay_now":
            return True
    return False


class PlateauPolicy:
    """When ``metric`` has not improved by ``min_delta`` for ``patience`` evaluations in a row:
    ``action="halve"`` scales the rate by ``factor`` (again after each further ``patience``
    flat evaluations, at most ``max_actions`` times); ``action="decay"`` starts the cooldown
    (``decay_now steps=decay_steps to=decay_to shape=shape``) once, and never while the run's
    edits already hold one. ``mode="max"`` for a metric that grows (accuracy)."""

    def __init__(self, metric: str = "eval_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min",
                 action: str = "halve", factor: float = 0.5, decay_steps: int = 200, decay_to: float | str = "min_lr",
                 shape: str = "cosine", max_actions: int | None = None, name: str = "plateau") -> None:
        if action not in ("halve", "decay"):
            raise ValueError(f"PlateauPolicy: action: expected 'halve' or 'decay', got {action!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"PlateauPolicy: mode: expected 'min' or 'max', got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"PlateauPolicy: patience: expected a whole number >= 1, got {patience!r}")
        self.name, self.metric, self.patience, self.min_delta, self.mode = name, metric, patience, min_delta, mode
        self.action, self.factor, self.max_actions = action, factor, max_actions
        self.decay = {"op": "decay_now", "steps": decay_steps, "to": decay_to, "shape": shape}
        self.best: float | None = None
        self.stale = 0
        self.actions = 0

    def _better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def observe(self, seen: Observation) -> Action | None:
        """Count the flat evaluations among the new events; ask once ``patience`` is reached."""
        asked: Action | None = None
        for step, value in metric_values(seen.events, self.metric):
            if self._better(value):
                self.best, self.stale = value, 0
                continue
            self.stale += 1
            if self.stale < self.patience or asked is not None:
                continue
            if self.max_actions is not None and self.actions >= self.max_actions:
                continue
            if self.action == "decay" and _decaying(seen.snapshot):
                continue  # the cooldown has started (by this policy or anyone): once is enough
            why = (f"{self.metric} {value:.4g} at step {step} has not improved on {self.best:.4g} "
                   f"for {self.stale} evaluations")
            self.stale = 0
            self.actions += 1
            if self.action == "halve":
                asked = Action({"lr_scale": self.factor}, f"{why}: scale the rate by {self.factor:g}")
            else:
                asked = Action({"schedule": dict(self.decay)}, f"{why}: start the decay")
        return asked

    def declined(self, action: Action, note: str) -> None:
        """Not made: it does not count against ``max_actions``."""
        self.actions = max(0, self.actions - 1)


class SpikePolicy:
    """A cooldown after the guard's interventions: once ``interventions`` new ones are seen
    (the snapshot counts them), scale the rate by ``factor``; once ``calm_steps`` steps pass
    without another, scale it back (by ``1 / factor``). The limits must allow both
    (``lr_scale`` in ``[factor, 1 / factor]``)."""

    def __init__(self, factor: float = 0.5, interventions: int = 1, calm_steps: int = 100,
                 name: str = "spike") -> None:
        if not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ValueError(f"SpikePolicy: factor: expected a number between 0 and 1, got {factor!r}")
        self.name, self.factor, self.threshold, self.calm_steps = name, float(factor), interventions, calm_steps
        self.seen: int | None = None  # the guard's count at the last poll (the first poll sets it)
        self.new = 0  # interventions since the last cooldown
        self.cooling_since: int | None = None  # the step of the newest intervention while cooling
        self.cooling_action: Action | None = None
        self.restore_action: Action | None = None
        self.step = 0

    def observe(self, seen: Observation) -> Action | None:
        """Start a cooldown after new interventions; end it after a calm stretch."""
        total, self.step = seen.snapshot.guard_interventions, seen.step
        if self.seen is None or total < self.seen:  # the first look, or a restarted run
            self.seen = total
            return None
        fresh, self.seen = total - self.seen, total
        if self.cooling_since is not None:
            if fresh:
                self.cooling_since = seen.step  # still spiking: the calm stretch starts again
                return None
            if seen.step - self.cooling_since >= self.calm_steps:
                self.cooling_since = None
                self.restore_action = Action({"lr_scale": 1 / self.factor},
                                             f"no guard intervention for {self.calm_steps} steps: end the cooldown "
                                             f"(scale the rate by {1 / self.factor:g})")
                return self.restore_action
            return None
        self.new += fresh
        if self.new < self.threshold:
            return None
        kinds = sorted({i.kind for i in seen.snapshot.interventions[-self.new:]}) or ["?"]
        count, self.new = self.new, 0
        self.cooling_since = seen.step
        self.cooling_action = Action({"lr_scale": self.factor},
                                     f"{count} guard intervention(s) ({', '.join(kinds)}) by step {seen.step}: "
                                     f"cool down (scale the rate by {self.factor:g})")
        return self.cooling_action

    def declined(self, action: Action, note: str) -> None:
        """A cooldown not made is not under way (nothing to scale back later); an end of the
        cooldown not made is asked for again after another calm stretch."""
        if action is self.cooling_action:
            self.cooling_since, self.cooling_action = None, None
        elif action is self.restore_action:
            self.cooling_since, self.restore_action = self.step, None
