"""Default losses by model kind, in the spirit of transformers' LOSS_MAPPING.

Every loss takes ``num_items_in_batch``: the number of target items across the whole
accumulated batch (all micro-batches of one optimizer step, all processes when tokens are
averaged across devices). With it, the loss is a *sum* divided by that count, so k
accumulated micro-batches produce exactly the gradient of one k-times larger batch. Without
it, the loss is the plain mean over this micro-batch's targets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from workbench.models.kinds import model_kind

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "LOSS_MAPPING",
    "causal_lm_loss",
    "classification_loss",
    "token_classification_loss",
    "count_target_items",
    "model_kind",
]


def _reduce(loss_sum: torch.Tensor, loss_mean_fallback: Callable[[], torch.Tensor], num_items: Any) -> torch.Tensor:
    if num_items is None:
        return loss_mean_fallback()
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(loss_sum.device)
    return loss_sum / num_items


def fixed_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross entropy summed over targets and divided by ``num_items_in_batch`` (or mean)."""
    logits = logits.float()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing)
    loss = F.cross_entropy(
        logits, targets, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
    )
    return _reduce(loss, lambda: loss, num_items_in_batch)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    **_: Any,
) -> torch.Tensor:
    """Next-token loss: position t predicts labels[t + 1]; -100 labels are ignored."""
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    return fixed_cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        num_items_in_batch,
        ignore_index,
        label_smoothing,
    )


def classification_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    problem_type: str | None = None,
    **_: Any,
) -> torch.Tensor:
    """Sequence/image classification by transformers' problem types: ``problem_type`` (the
    model's ``config.problem_type``) when set, else regression for one output, multi-label
    (binary cross entropy per class) for several outputs with float labels, single-label
    cross entropy for integer labels."""
    labels = labels.to(logits.device)
    if problem_type is None and (logits.size(-1) == 1 or labels.is_floating_point()):
        problem_type = "regression" if logits.size(-1) == 1 else "multi_label_classification"
    if problem_type == "regression":
        predicted = logits.squeeze(-1) if logits.size(-1) == 1 else logits
        loss = F.mse_loss(predicted.float(), labels.reshape(predicted.shape).float(), reduction="sum")
        return _reduce(loss, lambda: loss / labels.numel(), num_items_in_batch)
    if problem_type == "multi_label_classification":
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")
        return _reduce(loss, lambda: loss / labels.numel(), num_items_in_batch)
    return fixed_cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), num_items_in_batch,
                               label_smoothing=label_smoothing)


def token_classification_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    **_: Any,
) -> torch.Tensor:
    """Per-token classification (and masked LM): no shift, -100 ignored."""
    return fixed_cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        labels.reshape(-1).to(logits.device),
        num_items_in_batch,
        label_smoothing=label_smoothing,
    )


LOSS_MAPPING: dict[str, Callable[..., torch.Tensor]] = {
    "ForCausalLM": causal_lm_loss,
    "ForMaskedLM": token_classification_loss,
    "ForTokenClassification": token_classification_loss,
    "ForSequenceClassification": classification_loss,
    "ForImageClassification": classification_loss,
    "ForAudioClassification": classification_loss,
    "ForVideoClassification": classification_loss,
    "ForMultipleChoice": classification_loss,
}


def count_target_items(labels: torch.Tensor, kind: str | None) -> torch.Tensor:
    """Targets in ``labels`` that count toward the loss (a device tensor: no host sync).

    Causal LMs count the shifted labels (position 0 never is a target).
    """
    if kind == "ForCausalLM":
        labels = labels[..., 1:]
    if labels.is_floating_point():
        return torch.tensor(labels.numel(), device=labels.device)
    return (labels != IGNORE_INDEX).sum()
