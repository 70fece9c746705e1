"""Hooks for examples/tiny-gpt.toml: a custom loss and metrics, referenced as
"hooks:NAME" from the config (modules next to the config are found first)."""

from __future__ import annotations

import math

import numpy as np
import torch.nn.functional as F


def token_loss(outputs, labels, num_items_in_batch=None):
    """Next-token cross entropy summed over real targets, divided by the number of targets in
    the whole accumulated batch, so gradient accumulation matches one large batch."""
    logits = outputs["logits"].float()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-100, reduction="sum")
    if num_items_in_batch is None:
        return loss / (targets != -100).sum().clamp(min=1)
    return loss / num_items_in_batch


def argmax_logits(logits, labels):
    """Keep only the predicted ids for metrics: a few bytes per token instead of the vocabulary."""
    return logits.argmax(dim=-1)


def compute_metrics(eval_pred):
    """Next-token accuracy and perplexity (from the per-example eval losses)."""
    preds, labels = eval_pred.predictions[:, :-1], eval_pred.label_ids[:, 1:]
    mask = labels != -100
    metrics = {"accuracy": float((preds[mask] == labels[mask]).mean())}
    if eval_pred.losses is not None:
        metrics["perplexity"] = math.exp(float(np.mean(eval_pred.losses)))
    return metrics
