"""The Session's data model: statuses, immutable snapshots, typed events, checkpoint rows,
memory figures and compact series.

These are the value types of the front-end door (``workbench.door.protocol``): plain
data only (numbers, strings, tuples, dicts), no torch and no trainer objects, so a
front-end can import them without the training stack, and a client of a run in another
process can rebuild them from JSON. Kept apart from local.py (threads and commands).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.core.ledger import goodput_line  # noqa: F401 - front-ends format the ledger with it
from workbench.core.records import CheckpointRow, MemoryUsage, edit_changes, is_timing_metric
from workbench.door.proposals import Proposal, describe_proposal_event

__all__ = ["goodput_line", "Status", "ENDED", "LOOP_HELD", "Snapshot", "SessionEvent", "CheckpointRow", "MemoryUsage", "Intervention", "SNAPSHOT_INTERVENTIONS",
           "SNAPSHOT_EDITS", "SeriesStore", "Proposal", "describe_proposal_event",
           "is_timing_metric", "edit_changes"]


class Status(enum.StrEnum):
    """Where a run is. The one definition of the status words: a ``str`` enum, so
    ``status == "paused"`` and JSON keep working with the plain words."""

    IDLE = "idle"              # made, not started (or not restarted yet)
    RUNNING = "running"        # training steps
    PAUSING = "pausing"        # a pause was asked for; it lands at the next step boundary
    PAUSED = "paused"          # the loop waits at a step boundary; inspect, save, evaluate, edit
    EVALUATING = "evaluating"  # an evaluation inside the loop
    SAVING = "saving"          # a checkpoint asked for while running is being written
    STOPPING = "stopping"      # a stop was asked for; it lands at the next safe point
    FINISHED = "finished"      # reached max_steps
    STOPPED = "stopped"        # ended early (a stop, a signal, a callback)
    FAILED = "failed"          # an exception ended the run

    @property
    def ended(self) -> bool:
        """Whether the run's thread has ended (finished, stopped or failed)."""
        return self in ENDED


# The statuses of a run whose thread has ended.
ENDED: frozenset[Status] = frozenset({Status.FINISHED, Status.STOPPED, Status.FAILED})
# The statuses in which the training loop is not running a step (the model can be read).
LOOP_HELD: frozenset[Status] = frozenset({Status.PAUSED, Status.IDLE, *ENDED})


@dataclass(frozen=True)
class SessionEvent:
    """Something that happened: logged, evaluated, saved, paused, resumed, edited, finished, failed..."""

    kind: str
    step: int
    time: float
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Intervention:
    """One step the guard acted on (a ``guard`` event, train/guard.py), as plain data.

    ``kind``: "nonfinite" or "spike"; ``action``: skip, rollback, pause or stop;
    ``value`` / ``threshold``: the step's loss and the spike bar (NaN/inf arrive as the
    strings "nan"/"inf", as events.jsonl writes them, so snapshots stay comparable);
    ``samples``: the dataset rows of the step over all ranks (empty when the data order is
    not known); ``restored_step`` / ``skipped_samples``: a rollback's target step and how many
    rows it jumped over (None otherwise).
    """

    step: int
    kind: str
    action: str
    value: float | str | None = None
    threshold: float | str | None = None
    rank: int = 0
    samples: tuple[int, ...] = ()
    restored_step: int | None = None
    skipped_samples: int | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "Intervention":
        """From a guard record or event (``skipped_sample_count`` gives ``skipped_samples``),
        or from ``to_dict``'s output (extra keys are ignored)."""
        skipped = record.get("skipped_samples")
        if not isinstance(skipped, int) or isinstance(skipped, bool):
            skipped = record.get("skipped_sample_count")
        return cls(step=int(record["step"]), kind=str(record.get("kind", "")), action=str(record.get("action", "")),
                   value=record.get("value"), threshold=record.get("threshold"), rank=int(record.get("rank", 0)),
                   samples=tuple(int(i) for i in record.get("samples") or ()),
                   restored_step=record.get("restored_step"), skipped_samples=skipped)

    def to_dict(self) -> dict[str, Any]:
        """As a JSON-friendly dict (``from_record`` reads it back)."""
        return {**asdict(self), "samples": list(self.samples)}


Point = tuple[int, float]

# A snapshot lists at most this many interventions (the newest): every poll of every client
# carries the list, and a run without max_interventions may pile up thousands.
SNAPSHOT_INTERVENTIONS = 256
# The same for live edits: the newest ones (edit_count counts all; events.jsonl and the
# trainer state keep every one). 1,000 edits with long reasons made every snapshot too big to send.
SNAPSHOT_EDITS = 50


@dataclass(frozen=True)
class Snapshot:
    """What a front-end shows, frozen at one moment. Series are tuples of (step, value)."""

    status: Status = Status.IDLE
    step: int = 0
    max_steps: int = 0
    epoch: float | None = None
    elapsed: float = 0.0  # training time: time spent paused is not in it (``paused`` is)
    paused: float = 0.0  # seconds spent paused so far (a pause in progress included)
    steps_per_second: float = 0.0
    samples_per_second: float = 0.0
    tokens_per_second: float | None = None
    eta: float | None = None
    series: dict[str, tuple[Point, ...]] = field(default_factory=dict)
    best_metric: float | None = None
    best_step: int | None = None
    memory: MemoryUsage | None = None
    checkpoints: tuple[CheckpointRow, ...] = ()
    edits: tuple[dict[str, Any], ...] = ()  # the newest SNAPSHOT_EDITS live edits, oldest first
    edit_count: int = 0  # every live edit of the run
    guard_interventions: int = 0  # non-finite/spiking steps the guard acted on (train/guard.py)
    interventions: tuple[Intervention, ...] = ()  # the newest SNAPSHOT_INTERVENTIONS of them, oldest first
    error: str | None = None  # "BoomError: ..." once the run failed
    stop_reason: str | None = None  # who stopped it, a code door/endings.py words ("ctl", "SIGTERM", ...)
    traceback: str | None = None  # the failed run's formatted traceback (text, not an exception object)
    run_name: str | None = None
    output_dir: str | None = None
    device: str | None = None
    updated: float = 0.0
    # Run health: {"ledger": seconds by category (core/ledger.py), "throughput": the rates of
    # the steps last logged, "hang": the hang under way (None once its rank moved on),
    # "stragglers": {"ranks": [...]}, "ranks": {"<rank>": {"step", "phase", "work_per_step",
    # "factor"}} with several ranks (distributed/health.py)}.
    health: dict[str, Any] | None = None
    # The learning rate planned for the rest of the run, (step, rate) on the logged rate's axis:
    # the schedule with its live changes (front-ends draw it dashed after the logged rate).
    lr_plan: tuple[Point, ...] = ()
    # The latest A/B fork from a pause (session/fork_commands.py), as plain data: each
    # variant's loss per step and evaluation, its state ("running", "done", "kept", ...).
    fork: dict[str, Any] | None = None
    # The changes proposed to the run (door/proposals.py): every pending one and the newest
    # decided ones, oldest first; any front-end on the run accepts or rejects them (decide()).
    proposals: tuple[Proposal, ...] = ()

    @classmethod
    def empty(cls) -> "Snapshot":
        """The snapshot of a session that has not started."""
        return cls()

    @property
    def progress(self) -> float:
        """Fraction of max_steps done (0..1)."""
        return self.step / self.max_steps if self.max_steps else 0.0

    def latest(self, name: str) -> float | None:
        """The newest value of a series, or None."""
        points = self.series.get(name)
        return points[-1][1] if points else None


class _Series:
    """One bounded series: the newest quarter of ``limit`` points at full detail, and older
    points at a uniform stride that doubles each time the history fills up. (Thinning the
    older half again and again would erase the history exponentially: a million-step run
    would keep its first point and the last 0.6% of the steps.)"""

    __slots__ = ("recent", "history", "history_limit", "stride", "aged")

    def __init__(self, limit: int) -> None:
        size = max(limit // 4, 1)
        self.recent: collections.deque[Point] = collections.deque(maxlen=size)
        self.history: list[Point] = []
        self.history_limit = max(limit - size, 1)
        self.stride = 1
        self.aged = 0  # points that have left `recent`

    def add(self, point: Point) -> None:
        if len(self.recent) == self.recent.maxlen:
            if self.aged % self.stride == 0:  # history keeps every stride-th aged point
                self.history.append(self.recent[0])
                if len(self.history) > self.history_limit:
                    self.history = self.history[::2]
                    self.stride *= 2
            self.aged += 1
        self.recent.append(point)

    def points(self) -> tuple[Point, ...]:
        return (*self.history, *self.recent)


class SeriesStore:
    """Named (step, value) series that stay bounded (at most ``limit`` points each): recent
    points in full detail, the whole run's history downsampled evenly, first point kept."""

    def __init__(self, limit: int = 2000) -> None:
        self.limit = limit
        self._data: dict[str, _Series] = {}
        self._frozen: dict[str, tuple[Point, ...]] | None = None

    def add(self, name: str, step: int, value: Any) -> None:
        """Append one point (non-numbers are ignored)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        series = self._data.get(name)
        if series is None:
            series = self._data[name] = _Series(self.limit)
        series.add((step, float(value)))
        self._frozen = None

    def add_log(self, step: int, logs: dict[str, Any]) -> None:
        """Train-side values of an on_log call (loss, learning_rate, grad_norm)."""
        for key in ("loss", "learning_rate", "grad_norm"):
            if key in logs:
                self.add(key, step, logs[key])

    def add_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """Every numeric evaluation metric, except timings (and the epoch and token count
        that evaluate() adds to its metrics, as HF's does)."""
        for key, value in metrics.items():
            if not is_timing_metric(key) and "_mem_" not in key and key not in ("epoch", "num_input_tokens_seen"):
                self.add(key, step, value)

    def frozen(self) -> dict[str, tuple[Point, ...]]:
        """An immutable copy (cached until the next add)."""
        if self._frozen is None:
            self._frozen = {k: v.points() for k, v in self._data.items()}
        return self._frozen
