"""MLPClassifier: a small feed-forward classifier for the synthetic classification demo.

It trains in seconds on a CPU, so tests of the training loop (accumulation, evaluation,
weight-decay grouping) can run many steps; LayerNorm and biases are included on purpose so
the "no decay for norms and biases" rule has something to act on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workbench.models.losses import classification_loss

__all__ = ["MLPClassifier"]


class MLPClassifier(nn.Module):
    """``n_layer`` hidden blocks of Linear -> LayerNorm -> GELU -> Dropout, then a linear head."""

    loss_type = "ForSequenceClassification"
    main_input_name = "x"
    _count: int | None = None  # parameters, for floating_point_ops

    def __init__(
        self,
        in_features: int = 32,
        hidden: int = 64,
        num_classes: int = 4,
        n_layer: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("hidden", hidden),
                            ("num_classes", num_classes), ("n_layer", n_layer)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.config: dict[str, Any] = {
            "in_features": in_features,
            "hidden": hidden,
            "num_classes": num_classes,
            "n_layer": n_layer,
            "dropout": dropout,
        }
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(n_layer):
            layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Number of parameters, optionally only those that require grad (``exclude_embeddings``
        is accepted as transformers' models take it: an MLP has none)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Operations of a forward and backward pass (the Trainer's total_flos): about 6 per
        parameter and sample (2 forward, 4 backward), each sample being one row of ``x``."""
        x = inputs.get(self.main_input_name) if hasattr(inputs, "get") else None
        if x is None:
            return 0
        if self._count is None:  # counted once: called for every micro-batch
            self._count = self.num_parameters()
        return 6 * x.shape[0] * self._count

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        """Class logits for ``x`` of shape (batch, in_features), plus the loss given ``labels``.

        The loss is :func:`workbench.models.losses.classification_loss`, a sum divided by
        ``num_items_in_batch`` when that is given (exact gradient accumulation), else a mean.
        Extra keyword arguments are ignored so generic collators can pass more keys.
        """
        logits = self.head(self.body(x))
        if labels is None:
            return {"logits": logits}
        loss = classification_loss(logits, labels, num_items_in_batch=num_items_in_batch)
        return {"loss": loss, "logits": logits}
