"""Batch collation: HF's ``default_data_collator`` semantics and column removal.

Kept apart from data.py (loading and sampling) because the Trainer needs these two on
every path and they must stay import-light.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["default_data_collator", "RemoveColumnsCollator", "signature_columns"]

log = logging.getLogger("workbench")


def _as_tensor(values: Sequence[Any]) -> torch.Tensor:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(values))
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(values))
    return torch.tensor(values)


def default_data_collator(features: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack a list of dict examples into a batch of tensors.

    As in transformers: a "label" or "label_ids" key becomes "labels" (int labels as long,
    float labels as float); strings and None values are left out of the batch.
    """
    if not features:
        return {}
    if not isinstance(features[0], Mapping):
        # Plain tuples/tensors: let torch do what it does for non-dict datasets.
        return torch.utils.data.default_collate(features)
    first = features[0]
    batch: dict[str, Any] = {}
    label_key = "label" if "label" in first else "label_ids" if "label_ids" in first else None
    if label_key is not None and first[label_key] is not None:
        labels = [f[label_key] for f in features]
        tensor = _as_tensor(labels)
        if not tensor.is_floating_point():
            tensor = tensor.long()
        batch["labels"] = tensor
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None or isinstance(value, str):
            continue
        batch[key] = _as_tensor([f[key] for f in features])
    return batch


def signature_columns(model: torch.nn.Module, label_names: Sequence[str] = ()) -> set[str] | None:
    """Names the model's forward accepts (plus labels); None if it takes ``**kwargs``."""
    forward = getattr(model, "forward", model)
    params = inspect.signature(forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params) | {"label", "label_ids", "labels", *label_names}


class RemoveColumnsCollator:
    """Drops example keys the model's forward does not accept, then collates.

    The dropped names are reported once, so a user learns why a column vanished.
    """

    def __init__(self, collator: Callable, keep: set[str], description: str = "training") -> None:
        self.collator = collator
        self.keep = keep
        self.description = description
        self._reported = False

    def __call__(self, features: list[Any]) -> Any:
        if features and isinstance(features[0], Mapping):
            dropped = set(features[0]) - self.keep
            if dropped:
                if not self._reported:
                    log.info(
                        "%s: dropping columns the model's forward does not accept: %s",
                        self.description, ", ".join(sorted(dropped)),
                    )
                    self._reported = True
                features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collator(features)
