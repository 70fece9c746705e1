"""Built-in metrics, referenced from a config as ``"workbench.metrics:NAME"``.

``compute_metrics`` functions receive an ``EvalPrediction`` of numpy arrays; the causal-LM
variants compare the prediction at position t with the label at t + 1, as the reference's
example does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["accuracy", "token_accuracy", "perplexity", "argmax_logits", "lm_metrics"]

IGNORE_INDEX = -100


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


def argmax_logits(logits: Any, labels: Any) -> Any:
    """``preprocess_logits_for_metrics``: keep the argmax ids, not the logits (memory)."""
    return _first(logits).argmax(dim=-1)


def accuracy(eval_pred: Any) -> dict[str, float]:
    """Classification accuracy; predictions may be logits or class ids."""
    preds, labels = np.asarray(_first(eval_pred.predictions)), np.asarray(eval_pred.label_ids)
    if preds.ndim == labels.ndim + 1:
        preds = preds.argmax(-1)
    mask = labels != IGNORE_INDEX
    return {"accuracy": float((preds[mask] == labels[mask]).mean()) if mask.any() else float("nan")}


def token_accuracy(eval_pred: Any) -> dict[str, float]:
    """Next-token accuracy of a causal LM (prediction at t vs label at t + 1)."""
    preds, labels = np.asarray(_first(eval_pred.predictions)), np.asarray(eval_pred.label_ids)
    if preds.ndim == labels.ndim + 1:
        preds = preds.argmax(-1)
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != IGNORE_INDEX
    return {"accuracy": float((preds[mask] == labels[mask]).mean()) if mask.any() else float("nan")}


def perplexity(eval_pred: Any) -> dict[str, float]:
    """exp(mean eval loss). Needs the losses: set include_for_metrics = ["loss"]."""
    if eval_pred.losses is None:
        raise ValueError('perplexity needs the evaluation losses: set training.include_for_metrics = ["loss"]')
    mean = float(np.mean(np.asarray(eval_pred.losses, dtype=np.float64)))
    return {"perplexity": math.exp(min(mean, 700.0))}


def lm_metrics(eval_pred: Any) -> dict[str, float]:
    """Token accuracy, plus perplexity when the losses are included."""
    out = token_accuracy(eval_pred)
    if eval_pred.losses is not None:
        out.update(perplexity(eval_pred))
    return out
