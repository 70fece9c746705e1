"""workbench: an interactive training workbench for PyTorch.

The public names are imported lazily, so ``import workbench`` stays fast and pulls in
neither torch nor accelerate until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TrainingArguments": "core.args.training",
    "Trainer": "train.trainer",
    "Guard": "guard.settings",
    "Health": "distributed.health",
    "TrainerCallback": "core.callbacks",
    "TrainerState": "core.state",
    "TrainerControl": "core.state",
    "EarlyStoppingCallback": "train.callbacks",
    "SamplesCallback": "train.samples",
    "Samples": "train.samples",
    "PrinterCallback": "train.callbacks",
    "ProgressCallback": "train.callbacks",
    "ExportableState": "core.state",
    "DEFAULT_CALLBACKS": "train.trainer",
    "DefaultFlowCallback": "train.callbacks",
    "EvalPrediction": "core.trainer_utils",
    "PredictionOutput": "core.trainer_utils",
    "TrainOutput": "core.trainer_utils",
    "set_seed": "core.trainer_utils",
    "default_data_collator": "data.collators",
    "CheckpointStore": "checkpoint.store",
    "load_config": "config.loader",
    "RunConfig": "config.loader",
    "build_trainer": "config.build",
    "Session": "session.local",
    "SessionLike": "door.protocol",
    "Status": "door.values",
    "Snapshot": "door.values",
    "SessionEvent": "door.values",
    "attach": "control.client",
    "RemoteSession": "control.client",
}

__all__ = [*_EXPORTS, "__version__"]


def _train_with_control(trainer: Any, **train_kwargs: Any) -> Any:
    """Trainer.train() with ``control = true``: the session layer trains it and serves the endpoint."""
    from workbench.session.served import train_with_control

    return train_with_control(trainer, **train_kwargs)


def _register_control_runner() -> None:
    # The Trainer calls a slot (workbench/core/serving.py) and never imports the session layer; this
    # package file runs before any workbench.* module is imported, so every Trainer sees it.
    from workbench.core.serving import register_control_runner

    register_control_runner(_train_with_control)


_register_control_runner()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
