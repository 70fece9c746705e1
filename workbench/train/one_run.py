"""One training run at a time in a process.

Accelerate keeps its state in process-wide singletons: ``AcceleratorState`` (precision,
device), which each new Trainer resets, and ``GradientState``, whose stack of the data
loaders being iterated decides how ``gather_for_metrics`` trims the last batch of an
evaluation. Two runs in one process therefore corrupt each other without an error: a
second Trainer built while the first trains resets the first's precision, and an
evaluation on one thread trims its batches by the other run's training loader (wrong
metrics, or predictions and labels of different lengths). A notebook cell run twice is
enough to get there.

So a Trainer's ``train()`` claims the process for as long as it runs (paused included), and
building another Trainer or training it meanwhile is refused with a one-line error that
names the run in the way and how to stop it. A claim by the Trainer that already holds the
process nests (a callback may call its own Trainer's methods); only another Trainer is refused.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["RunInProgressError", "training_run", "claim", "check_free"]


class RunInProgressError(RuntimeError):
    """Another run is training in this process (paused counts): two would share Accelerate's state."""


_lock = threading.Lock()
_holder: "weakref.ReferenceType[Any] | None" = None  # the Trainer whose train() is under way
_depth = 0


def training_run() -> Any:
    """The Trainer training in this process (its ``train()`` under way, paused or not), or None."""
    with _lock:
        return _holder() if _holder is not None else None


def _refusal(trainer: Any, wanted: str) -> str:
    args = getattr(trainer, "args", None)
    out = getattr(args, "output_dir", "?")
    state = getattr(trainer, "state", None)
    step = getattr(state, "global_step", "?")
    if getattr(trainer, "control_owner", None) is not None:  # a Session: reachable by name and endpoint
        how = f"stop it first (Session.running().stop() in Python, or `workbench ctl {out} stop`)"
    else:
        how = "let its train() return first"
    return (f"cannot {wanted}: another run is training in this process ({out}, step {step}); {how}, "
            f"or use another process: two runs in one process would share Accelerate's state")


def check_free(wanted: str) -> None:
    """Raise RunInProgressError if a run is training in this process; ``wanted`` says what was
    refused ("build a Trainer")."""
    holder = training_run()
    if holder is not None:
        raise RunInProgressError(_refusal(holder, wanted))


@contextlib.contextmanager
def claim(trainer: Any) -> Iterator[None]:
    """Hold the process for ``trainer``'s run; refused while another Trainer holds it."""
    global _holder, _depth
    with _lock:
        holder = _holder() if _holder is not None else None
        if holder is not None and holder is not trainer:
            raise RunInProgressError(_refusal(holder, "train"))
        _holder, _depth = weakref.ref(trainer), _depth + 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _holder = None
