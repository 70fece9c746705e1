"""The Session's data model: immutable snapshots, typed events, compact series, live edits.

Kept apart from session.py (threads and commands) so front-ends and tests can use the data
types without the control machinery.
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["Snapshot", "SessionEvent", "SeriesStore", "EDITABLE", "apply_edit", "rng_preserved"]


@dataclass(frozen=True)
class SessionEvent:
    """Something that happened: logged, evaluated, saved, paused, resumed, edited, finished, failed..."""

    kind: str
    step: int
    time: float
    data: dict[str, Any] = field(default_factory=dict)


Point = tuple[int, float]


@dataclass(frozen=True)
class Snapshot:
    """What a front-end shows, frozen at one moment. Series are tuples of (step, value)."""

    status: str = "idle"
    step: int = 0
    max_steps: int = 0
    epoch: float | None = None
    elapsed: float = 0.0
    steps_per_second: float = 0.0
    samples_per_second: float = 0.0
    tokens_per_second: float | None = None
    eta: float | None = None
    series: dict[str, tuple[Point, ...]] = field(default_factory=dict)
    best_metric: float | None = None
    best_step: int | None = None
    memory: Any = None
    checkpoints: tuple = ()
    edits: tuple[dict[str, Any], ...] = ()
    error: str | None = None
    run_name: str | None = None
    output_dir: str | None = None
    device: str | None = None
    updated: float = 0.0

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
        """Every numeric evaluation metric, except timings."""
        for key, value in metrics.items():
            if not key.endswith(("_runtime", "_per_second")) and "_mem_" not in key:
                self.add(key, step, value)

    def frozen(self) -> dict[str, tuple[Point, ...]]:
        """An immutable copy (cached until the next add)."""
        if self._frozen is None:
            self._frozen = {k: v.points() for k, v in self._data.items()}
        return self._frozen


# -- live edits ------------------------------------------------------------------------


def _positive_number(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return check


def _positive_int(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive whole number, got {value!r}")
    return check


def _non_negative_number(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
    return check


EDITABLE: dict[str, Callable[[Any], None]] = {
    "learning_rate": _non_negative_number("learning_rate"),
    "lr_scale": _positive_number("lr_scale"),
    "max_steps": _positive_int("max_steps"),
    "num_train_epochs": _positive_number("num_train_epochs"),
    "logging_steps": _positive_int("logging_steps"),
    "eval_steps": _positive_int("eval_steps"),
    "save_steps": _positive_int("save_steps"),
}


def _set_base_lrs(trainer: "Trainer", base_lrs: list[float]) -> None:
    """Set the rates the schedule scales from, and the current rates to match at once."""
    scheduler = trainer.lr_scheduler
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if scheduler is None or optimizer is None:
        raise ValueError("learning_rate: the optimizer does not exist yet; start the run first")
    factors = [lr / base if base else 0.0 for lr, base in zip(scheduler.get_last_lr(), scheduler.base_lrs)]
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(optimizer.param_groups, base_lrs, factors):
        group["initial_lr"] = base
        group["lr"] = base * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def apply_edit(trainer: "Trainer", key: str, value: Any) -> Any:
    """Apply one live edit at a step boundary; returns the value applied."""
    EDITABLE[key](value)
    state = trainer.state
    if key == "learning_rate":
        _set_base_lrs(trainer, [float(value)] * len(trainer.lr_scheduler.base_lrs))
    elif key == "lr_scale":
        _set_base_lrs(trainer, [base * float(value) for base in trainer.lr_scheduler.base_lrs])
    elif key == "max_steps":
        if value < state.global_step:
            raise ValueError(f"max_steps: {value} is below the current step {state.global_step}")
        state.max_steps = int(value)
        per_epoch = getattr(trainer, "_updates_per_epoch", None)
        if per_epoch:
            state.num_train_epochs = math.ceil(state.max_steps / per_epoch)
    elif key == "num_train_epochs":
        # Optimizer steps per epoch, as the loop planned them (max_steps / num_train_epochs is
        # not it when max_steps is not a whole number of epochs).
        per_epoch = getattr(trainer, "_updates_per_epoch", None)
        if not per_epoch:
            raise ValueError("num_train_epochs: this run has no epoch length (streaming data, or not "
                             "started); edit max_steps")
        new_max = math.ceil(per_epoch * value)
        if new_max < state.global_step:
            raise ValueError(f"num_train_epochs: {value} epochs end before the current step {state.global_step}")
        state.max_steps = new_max
        state.num_train_epochs = math.ceil(value)
    else:  # logging_steps / eval_steps / save_steps: the flow callback reads them from the state
        setattr(state, key, int(value))
    return value


def replay_edits(trainer: "Trainer") -> None:
    """After a resume: re-apply the edits that the restored files do not already carry.

    The schedule's base rates come back with scheduler.pt and the step intervals with
    trainer_state.json; max_steps is recomputed from the arguments on resume, so the last
    edited value (of max_steps, or of num_train_epochs converted to steps) is put back here.
    """
    per_epoch = getattr(trainer, "_updates_per_epoch", None)
    for edit in trainer.state.live_edits:
        for key, value in edit.items():  # in the order they were applied
            if key == "max_steps":
                trainer.state.max_steps = int(value)
            elif key == "num_train_epochs" and per_epoch:
                trainer.state.max_steps = math.ceil(per_epoch * value)


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Save every RNG state (python, numpy, torch CPU and CUDA) and restore it afterwards."""
    import numpy as np
    import torch

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def save_between_steps(trainer: "Trainer") -> Any:
    """Save a checkpoint outside the loop (a paused run): RNG streams untouched, the files
    published before this returns, on_save callbacks told. Returns the checkpoint path."""
    from .checkpoints import save_checkpoint

    with rng_preserved():
        path = save_checkpoint(trainer)
        trainer.checkpoint_writer.wait()
    trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    return path


def evaluate_between_steps(trainer: "Trainer") -> dict[str, float]:
    """Evaluate outside the loop (a paused run), leaving the RNG streams and train mode as they were."""
    model = trainer.model
    was_training = model.training
    with rng_preserved():
        try:
            return trainer.evaluate()
        finally:
            model.train(was_training)
