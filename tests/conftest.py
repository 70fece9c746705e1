"""Shared test helpers: training arguments for tiny runs, a stop-at-step callback, and one
torch thread for every test (tiny models on a shared 2-core machine: intra-op threads only
add contention).

``pytest -m "not slow"`` is the development loop; CI runs everything.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import TrainerCallback, TrainingArguments

__all__ = ["make_args", "StopAt", "hf_logs", "tiny_bert", "token_rows", "weights", "assert_bitwise", "Spawned"]


def make_args(out: str | Path, **overrides: Any) -> TrainingArguments:
    """Arguments for a quiet tiny run in ``out``: no progress printing, no trackers, no saves,
    a log line every step; ``overrides`` replace any of them."""
    options: dict[str, Any] = {"output_dir": str(out), "disable_tqdm": True, "report_to": "none",
                               "save_strategy": "no", "logging_steps": 1}
    options.update(overrides)
    return TrainingArguments(**options)


def tiny_bert() -> torch.nn.Module:
    """A small transformers BERT classifier (3 labels) built from a config, without dropout, so
    transformers' Trainer and workbench's take bitwise the same steps on it (needs transformers)."""
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def token_rows(n: int = 40, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of 8 random token ids (vocabulary 64) with labels 0, 1, 2 in turn."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 3)} for i in range(n)]


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


class Spawned(subprocess.Popen):
    """A process whose stdout and stderr go to files in ``logs``, read back by ``communicate``.

    A long run's progress lines fill an unread pipe (64 KiB) within a minute or so, and the
    run then blocks on its next print: a test that steers a live run must never hand it one.
    """

    def __init__(self, args: list[str], *, logs: Path, **kwargs: Any) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        stem = f"spawned-{time.monotonic_ns()}"
        self.paths = (logs / f"{stem}.stdout", logs / f"{stem}.stderr")
        self._files = [open(path, "w", encoding="utf-8") for path in self.paths]  # noqa: SIM115 - closed by communicate
        super().__init__(args, stdout=self._files[0], stderr=self._files[1], text=True, **kwargs)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[str, str]:  # noqa: A002
        """Wait for the process (raising TimeoutExpired like Popen) and return (stdout, stderr)."""
        self.wait(timeout)
        for f in self._files:
            f.close()
        return tuple(path.read_text(encoding="utf-8", errors="replace") for path in self.paths)  # type: ignore[return-value]
