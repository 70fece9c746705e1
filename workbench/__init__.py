"""workbench: an interactive training workbench for PyTorch.

The public names are imported lazily, so ``import workbench`` stays fast and pulls in
neither torch nor accelerate until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TrainingArguments": "args",
    "Trainer": "trainer",
    "TrainerCallback": "callbacks",
    "TrainerState": "callbacks",
    "TrainerControl": "callbacks",
    "EarlyStoppingCallback": "callbacks",
    "PrinterCallback": "callbacks",
    "DefaultFlowCallback": "callbacks",
    "EvalPrediction": "trainer_utils",
    "PredictionOutput": "trainer_utils",
    "TrainOutput": "trainer_utils",
    "set_seed": "trainer_utils",
    "default_data_collator": "collators",
    "CheckpointStore": "checkpoints",
    "load_config": "config",
    "RunConfig": "config",
    "build_trainer": "build",
    "Session": "session",
    "Snapshot": "session_state",
    "SessionEvent": "session_state",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
