"""HF's ``LabelSmoother``: label-smoothed cross entropy over a model's output, the object a
Trainer exposes as ``trainer.label_smoother`` when ``label_smoothing_factor > 0``.

The Trainer's own default loss smooths through ``F.cross_entropy(label_smoothing=...)``
(losses.py), the same quantity; this class is for code written against transformers that
calls ``self.label_smoother(outputs, labels)`` in its own ``compute_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workbench.models.losses import IGNORE_INDEX

__all__ = ["LabelSmoother"]


@dataclass
class LabelSmoother:
    """``(1 - epsilon) * NLL + epsilon * (mean over classes of -log p)``, averaged over the
    targets that are not ``ignore_index``, or divided by ``num_items_in_batch`` when given
    (a count over the whole accumulated batch, as the Trainer passes it)."""

    epsilon: float = 0.1
    ignore_index: int = IGNORE_INDEX

    def __call__(self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False,
                 num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
        if shift_labels:  # a causal LM: position t predicts token t + 1
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        neg_log_p = -F.log_softmax(logits, dim=-1)
        if labels.dim() == neg_log_p.dim() - 1:
            labels = labels.unsqueeze(-1)
        ignored = labels == self.ignore_index
        # Ignored positions index class 0 and are zeroed out, so gather never sees -100.
        nll = neg_log_p.gather(-1, labels.clamp(min=0)).masked_fill(ignored, 0.0)
        uniform = neg_log_p.sum(-1, keepdim=True, dtype=torch.float32).masked_fill(ignored, 0.0)
        if num_items_in_batch is None:
            count = ignored.numel() - ignored.sum()
        else:
            count = num_items_in_batch.to(nll.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        return (1 - self.epsilon) * nll.sum() / count + self.epsilon * uniform.sum() / (count * neg_log_p.shape[-1])
