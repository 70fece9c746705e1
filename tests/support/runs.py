"""Tiny real runs: quiet training arguments, small models built the way users build them,
a stop-at-step callback, and weights compared bitwise."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import TrainerCallback, TrainingArguments
from workbench.models import TinyGPT


def make_args(out: str | Path, **overrides: Any) -> TrainingArguments:
    """Arguments for a quiet tiny run in ``out``: no progress printing, no trackers, no saves,
    a log line every step; ``overrides`` replace any of them."""
    options: dict[str, Any] = {"output_dir": str(out), "disable_tqdm": True, "report_to": "none",
                               "save_strategy": "no", "logging_steps": 1}
    options.update(overrides)
    return TrainingArguments(**options)


def tiny_gpt(seed: int = 0, *, vocab_size: int, block_size: int, **overrides: Any) -> TinyGPT:
    """A one-layer TinyGPT (two heads, 16 wide unless ``overrides`` say otherwise) whose
    weights depend only on ``seed``."""
    torch.manual_seed(seed)
    options = {"vocab_size": vocab_size, "block_size": block_size, "n_layer": 1, "n_head": 2, "n_embd": 16}
    options.update(overrides)
    return TinyGPT(**options)


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


def _tensors(weights_or_model: dict[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(weights_or_model, torch.nn.Module):
        return dict(weights_or_model.state_dict())
    return weights_or_model


def assert_same_weights(got: dict[str, torch.Tensor] | torch.nn.Module,
                        expected: dict[str, torch.Tensor] | torch.nn.Module, what: str = "weights") -> None:
    """Two models (or two sets of weights by name) are bitwise equal, tensor by tensor; the
    failure names every tensor that differs."""
    a, b = _tensors(got), _tensors(expected)
    assert sorted(a) == sorted(b), f"{what}: different tensor names"
    differing = [name for name in b if not torch.equal(a[name], b[name])]
    assert not differing, f"{what}: tensors differ: {differing}"


def checkpoint_steps(out: Path) -> list[int]:
    """The steps of the checkpoint folders in ``out``, in order."""
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.is_dir())
