"""Small shared types and helpers of the Trainer (HF's trainer_utils names)."""

from __future__ import annotations

from workbench.core.names import PREFIX_CHECKPOINT_DIR

import os
import random
import time
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "EvalPrediction",
    "EvalLoopOutput",
    "PredictionOutput",
    "TrainOutput",
    "set_seed",
    "enable_full_determinism",
    "speed_metrics",
    "has_length",
    "PREFIX_CHECKPOINT_DIR",
]



class EvalPrediction:
    """What ``compute_metrics`` receives: predictions, label_ids, and optional inputs/losses.

    Iterates as ``(predictions, label_ids)`` (plus inputs/losses when present), like HF's.
    """

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        extras = tuple(x for x in (inputs, losses) if x is not None)
        self._elements = (predictions, label_ids, *extras)

    def __iter__(self):
        return iter(self._elements)

    def __getitem__(self, idx: int) -> Any:
        return self._elements[idx]

    def __len__(self) -> int:
        return len(self._elements)


class EvalLoopOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None
    num_samples: int | None


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices) for reproducible runs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        enable_full_determinism(seed)


def enable_full_determinism(seed: int) -> None:
    """Deterministic algorithms everywhere (slower), as HF's full_determinism."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def speed_metrics(split: str, start_time: float, num_samples: int | None = None,
                  num_steps: int | None = None, num_tokens: int | None = None) -> dict[str, float]:
    """``{split}_runtime`` and per-second rates since ``start_time`` (perf_counter)."""
    runtime = time.perf_counter() - start_time
    out = {f"{split}_runtime": round(runtime, 4)}
    if runtime <= 0:
        return out
    if num_samples is not None:
        out[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        out[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    if num_tokens is not None:
        out[f"{split}_tokens_per_second"] = round(num_tokens / runtime, 3)
    return out


def has_length(obj: Any) -> bool:
    """Whether ``len(obj)`` works (IterableDatasets and their loaders raise TypeError)."""
    try:
        return len(obj) is not None
    except (TypeError, NotImplementedError):
        return False


_WRAPPER_TYPES = {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "DeepSpeedEngine"}


def unwrap_model(model: Any) -> Any:
    """The user's module inside DDP / FSDP / DeepSpeed / torch.compile wrappers.

    Accelerate's ``unwrap_model`` imports ``torch._dynamo`` on first use (1-2 s of start-up
    on a small machine); recognising the wrappers by their attributes needs no import.
    """
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and type(model).__name__ in _WRAPPER_TYPES:
            inner = getattr(model, "module", None)
        if inner is None:
            return model
        model = inner
