"""The time ledger: every second of a run's wall time in exactly one category, per rank.

The ledger is a phase clock. The loop (and evaluation, a save, a pause) says which phase
the run is in now; the time since the last switch is booked to the phase that was current,
so the categories add up to the wall time by construction and nothing is sampled. A switch
costs one ``perf_counter`` call and a dict update (well under a microsecond of a step), and
only the training thread switches; other threads (the health watchdog, a front-end) read
the current phase and the totals without locks, the worst case being a reading one switch
old.

Phases are finer than the categories a user sees: forward, backward and optimizer are
"compute" in the summary but separate in a heartbeat, so a hang report can say a rank is
stuck in its backward (waiting in the gradients' all-reduce) rather than in its data.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["CATEGORIES", "PHASES", "Ledger", "goodput_line"]

# Phases in the order a step goes through them (a hang report names the rank furthest behind).
PHASES = ("startup", "data", "forward", "backward", "optimizer", "collective", "evaluation", "save", "paused",
          "other")
# What a user sees: the phases grouped, plus the time of steps a rollback undid.
CATEGORIES = ("startup", "compute", "data", "evaluation", "save", "paused", "rolled_back", "collective", "other")
_CATEGORY = {"forward": "compute", "backward": "compute", "optimizer": "compute"}
# The phases a hang is measured in: all but start-up (loading a large model may take minutes)
# and a pause (waiting for a person).
HANG_PHASES = ("data", "forward", "backward", "optimizer", "collective", "evaluation", "save", "other")


class Ledger:
    """Seconds by phase since the ledger was made, with the phase the run is in now."""

    def __init__(self, phase: str = "startup", clock=time.perf_counter) -> None:
        self._clock = clock
        self.started = clock()
        self.phase = phase
        self.since = self.started  # when the current phase began
        self.step = 0  # the step the run is at (set by the loop)
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.rolled_back = 0.0  # compute seconds of steps a rollback undid (moved out of compute)
        self._step_compute: list[tuple[int, float]] = []  # (step, compute seconds) since the last trim
        # With several ranks, each rank's summary ({"0": {...}, "1": {...}}), gathered as the
        # loop ends (train/loop.py) for the end record; None with one process.
        self.by_rank: dict[str, dict[str, float]] | None = None

    def enter(self, phase: str) -> str:
        """Book the time so far to the current phase, then switch to ``phase``; returns the
        phase it left (for :meth:`during` to go back to)."""
        now = self._clock()
        left = self.phase
        self.seconds[left] += now - self.since
        self.phase, self.since = phase, now
        return left

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """``phase`` for a block (an evaluation, a save, a pause), then back to the phase before."""
        left = self.enter(phase)
        try:
            yield
        finally:
            self.enter(left)

    def mark(self) -> None:
        """Progress within the current phase (an evaluation batch done): the phase's clock
        starts again, so a hang is measured from the last progress, not the phase's start."""
        self.enter(self.phase)

    def step_done(self, step: int, compute_seconds: float) -> None:
        """A step ended: remember its compute time, in case a rollback undoes it."""
        self.step = step
        self._step_compute.append((step, compute_seconds))
        if len(self._step_compute) > 4096:  # a rollback never reaches back further than its ring
            del self._step_compute[:2048]

    def undo_steps(self, back_to: int) -> None:
        """A rollback restored step ``back_to``: the compute time of the steps after it was
        spent for nothing, and is booked as rolled back."""
        undone = sum(seconds for step, seconds in self._step_compute if step > back_to)
        self._step_compute = [(s, t) for s, t in self._step_compute if s <= back_to]
        total = self.compute()
        moved = min(undone, total)
        for phase in ("forward", "backward", "optimizer"):  # taken out of compute in proportion
            self.seconds[phase] -= moved * (self.seconds[phase] / total if total else 0.0)
        self.rolled_back += moved
        self.step = back_to

    def compute(self) -> float:
        """Seconds of forward, backward and optimizer so far (the steps kept)."""
        return self.seconds["forward"] + self.seconds["backward"] + self.seconds["optimizer"]

    def wall(self) -> float:
        """Seconds since the ledger was made."""
        return self._clock() - self.started

    def summary(self) -> dict[str, float]:
        """Seconds by category (CATEGORIES) up to now, the current phase's time included, and
        ``wall``: their sum."""
        now = self._clock()
        phases = dict(self.seconds)
        phases[self.phase] += now - self.since
        out = dict.fromkeys(CATEGORIES, 0.0)
        for phase, seconds in phases.items():
            out[_CATEGORY.get(phase, phase)] += seconds
        out["rolled_back"] = self.rolled_back
        out["wall"] = now - self.started
        return {k: round(v, 4) for k, v in out.items()}

    def in_phase_for(self) -> float:
        """Seconds the run has been in its current phase."""
        return self._clock() - self.since


def goodput_line(summary: dict[str, float] | None, limit: int = 3) -> str:
    """"goodput 93%: data 4%, eval 2%, save 1%" from a summary: compute's share of the wall
    time, then the largest other shares (those under 0.5% left out)."""
    if not summary or not summary.get("wall"):
        return "goodput -"
    wall = summary["wall"]
    names = {"evaluation": "eval", "rolled_back": "rolled back", "collective": "waiting"}
    others = sorted(((v / wall, k) for k, v in summary.items() if k not in ("compute", "wall") and v / wall >= 0.005),
                    reverse=True)[:limit]
    parts = ", ".join(f"{names.get(k, k)} {share:.0%}" for share, k in others)
    head = f"goodput {summary.get('compute', 0.0) / wall:.0%}"
    return f"{head}: {parts}" if parts else head
