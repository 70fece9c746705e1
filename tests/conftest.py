"""Shared test helpers: training arguments for tiny runs, a stop-at-step callback, and one
torch thread for every test (tiny models on a shared 2-core machine: intra-op threads only
add contention).

``pytest -m "not slow"`` is the development loop; CI runs everything.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import TrainerCallback, TrainingArguments

__all__ = ["make_args", "StopAt", "hf_logs"]


def make_args(out: str | Path, **overrides: Any) -> TrainingArguments:
    """Arguments for a quiet tiny run in ``out``: no progress printing, no trackers, no saves,
    a log line every step; ``overrides`` replace any of them."""
    options: dict[str, Any] = {"output_dir": str(out), "disable_tqdm": True, "report_to": "none",
                               "save_strategy": "no", "logging_steps": 1}
    options.update(overrides)
    return TrainingArguments(**options)


@contextlib.contextmanager
def hf_logs(caplog: pytest.LogCaptureFixture, name: str = "transformers",
            level: int = logging.WARNING) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the ``name`` logger (a ``transformers.*`` one, where workbench gives the warnings
    HF's Trainer gives) in ``caplog``. Once transformers is imported its library logger stops
    propagating to the root, where caplog listens, so propagation is turned on meanwhile."""
    library = logging.getLogger("transformers")
    before = library.propagate
    library.propagate = True
    try:
        with caplog.at_level(level, logger=name):
            yield caplog
    finally:
        library.propagate = before


class StopAt(TrainerCallback):
    """Stop at the end of step ``n`` (an interruption at a step boundary), saving first unless
    ``save`` is False."""

    def __init__(self, n: int, save: bool = True) -> None:
        self.n, self.save = n, save

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_save = control.should_save or self.save
            control.should_training_stop = True


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
