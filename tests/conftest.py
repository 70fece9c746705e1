"""Shared test helpers: training arguments for tiny runs, a stop-at-step callback, and one
torch thread for every test (tiny models on a shared 2-core machine: intra-op threads only
add contention).

``pytest -m "not slow"`` is the development loop; CI runs everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import TrainerCallback, TrainingArguments

__all__ = ["make_args", "StopAt", "weights", "assert_bitwise"]


def make_args(out: str | Path, **overrides: Any) -> TrainingArguments:
    """Arguments for a quiet tiny run in ``out``: no progress printing, no trackers, no saves,
    a log line every step; ``overrides`` replace any of them."""
    options: dict[str, Any] = {"output_dir": str(out), "disable_tqdm": True, "report_to": "none",
                               "save_strategy": "no", "logging_steps": 1}
    options.update(overrides)
    return TrainingArguments(**options)


class StopAt(TrainerCallback):
    """Stop at the end of step ``n`` (an interruption at a step boundary), saving first unless
    ``save`` is False."""

    def __init__(self, n: int, save: bool = True) -> None:
        self.n, self.save = n, save

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_save = control.should_save or self.save
            control.should_training_stop = True


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    """A copy of the trainer's model weights, by name."""
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two sets of weights (from :func:`weights`) are bitwise equal, name by name."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
