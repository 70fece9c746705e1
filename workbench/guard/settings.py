"""What the user asks of the guard: the ``[guard]`` table, ``Trainer(guard=Guard(...))``,
``Session(trainer, guard=...)``; validated once, when it is made."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from workbench.core.args.training import ArgumentError

__all__ = ["Guard", "NONFINITE_ACTIONS", "SPIKE_ACTIONS", "GUARD_FIELDS"]

NONFINITE_ACTIONS = ("off", "skip", "rollback", "pause", "stop")
SPIKE_ACTIONS = ("off", "skip", "rollback", "pause")


@dataclass(frozen=True)
class Guard:
    """What to do about a non-finite or spiking loss; everything off by default (HF parity).

    ``nonfinite``: action when the step's loss (or gradient norm) is NaN/inf.
    ``spike``: action when the step's loss exceeds ``spike_factor`` x the running median of
    the last ``window`` accepted steps (checked once ``window`` steps were seen).
    ``snapshot_every`` / ``snapshots``: in-memory snapshots for rollback (steps apart, ring size);
    every checkpoint save is a snapshot too, so a resumed run rolls back as the uninterrupted one.
    ``rollback_skip``: data batches skipped past the spike after a rollback.
    ``lr_backoff``: factor applied to the learning rate after a rollback (None: unchanged).
    ``max_interventions``: after this many, pause an interactive run or stop a headless run
    with a checkpoint (None: no limit).
    ``max_no_progress``: escalate the same way when the guard makes no progress: this many
    interventions in a row without an accepted step between them (every step non-finite, or
    skipped), or this many rollbacks to the same step (None: never).
    """

    nonfinite: str = "off"
    spike: str = "off"
    spike_factor: float = 3.0
    window: int = 50
    snapshot_every: int = 50
    snapshots: int = 1
    rollback_skip: int = 0
    lr_backoff: float | None = None
    max_interventions: int | None = None
    max_no_progress: int | None = 10

    def __post_init__(self) -> None:
        # ArgumentError names the field: the config loader turns it into "file:line: guard.KEY: reason".
        if self.nonfinite not in NONFINITE_ACTIONS:
            raise ArgumentError("nonfinite", f"expected one of {', '.join(NONFINITE_ACTIONS)}, got {self.nonfinite!r}")
        if self.spike not in SPIKE_ACTIONS:
            raise ArgumentError("spike", f"expected one of {', '.join(SPIKE_ACTIONS)}, got {self.spike!r}")
        if isinstance(self.spike_factor, bool) or not isinstance(self.spike_factor, (int, float)) \
                or not math.isfinite(self.spike_factor) or self.spike_factor <= 1:
            raise ArgumentError("spike_factor", f"expected a number > 1, got {self.spike_factor!r}")
        for name, low in (("window", 1), ("snapshot_every", 1), ("snapshots", 1), ("rollback_skip", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(name, f"expected an integer >= {low}, got {value!r}")
        if self.lr_backoff is not None and (isinstance(self.lr_backoff, bool)
                                            or not isinstance(self.lr_backoff, (int, float))
                                            or not 0 < self.lr_backoff <= 1):
            raise ArgumentError("lr_backoff", f"expected a factor in (0, 1], got {self.lr_backoff!r}")
        for name in ("max_interventions", "max_no_progress"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ArgumentError(name, f"expected an integer >= 1, got {value!r}")

    @property
    def active(self) -> bool:
        """Whether anything is watched (an inactive guard costs the loop one attribute check)."""
        return self.nonfinite != "off" or self.spike != "off"

    @property
    def rolls_back(self) -> bool:
        """Whether an action is rollback (then the loop keeps a ring of in-memory snapshots)."""
        return "rollback" in (self.nonfinite, self.spike)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Guard":
        """A Guard from a ``[guard]`` table; unknown keys raise ArgumentError naming the key."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ArgumentError(key, f"unknown key (expected one of: {', '.join(names)})")
        return cls(**data)


GUARD_FIELDS = tuple(f.name for f in dataclasses.fields(Guard))
