"""The Trainer's loss: what the model takes and returns, read once (``_inspect_model``), and
HF's ``compute_loss`` override point with the default loss of the model's kind.

A mixin of :class:`workbench.train.trainer.Trainer`, like loaders.py and optim.py: users
override ``compute_loss`` on their Trainer subclass exactly as in transformers.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import torch
from torch import nn

import workbench.models.kinds as model_kinds
import workbench.models.losses as losses
from workbench.core.trainer_utils import unwrap_model
from workbench.train.label_smoothing import LabelSmoother

__all__ = ["TrainerLoss"]


class TrainerLoss:
    """The model's facts and the loss (the ``Run`` state they read is declared in core/run.py)."""

    def _inspect_model(self) -> None:
        model = unwrap_model(self.model)
        params = inspect.signature(model.forward).parameters
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.model_kind = losses.model_kind(model)
        flag = getattr(model, "accepts_loss_kwargs", None)  # as HF: a model's own word comes first
        self.model_accepts_loss_kwargs = flag if isinstance(flag, bool) else takes_kwargs or "num_items_in_batch" in params
        self._model_takes_labels = takes_kwargs or "labels" in params
        # A loss that ignores num_items_in_batch (BERT's heads) is computed from the logits by
        # its kind's loss when a count is given (model_kinds.py says why).
        self._model_loss_counts = model_kinds.loss_uses_item_count(model)
        self._loss_by_kind = (self.model_kind in losses.LOSS_MAPPING and self._model_takes_labels
                              and model_kinds.ignores_item_count(model))
        if self.args.label_names is not None:
            self.label_names = list(self.args.label_names)
        else:
            self.label_names = [n for n in params if "label" in n] or ["labels"]
        self.can_return_loss = self._model_takes_labels
        self.label_smoothing = self.args.label_smoothing_factor
        config = getattr(model, "config", None)
        problem = config.get("problem_type") if isinstance(config, dict) else getattr(config, "problem_type", None)
        self._problem_type = problem  # the classifier loss follows it (losses.classification_loss)
        if self.label_smoothing and problem == "multi_label_classification":
            # As HF: smoothing is defined over classes of one label, not independent binary ones.
            warnings.warn("Label smoothing is not compatible with multi-label classification. "
                          "Disabling label smoothing for this training run.", UserWarning, stacklevel=3)
            self.label_smoothing = 0.0
        # HF's attribute, for compute_loss overrides written against transformers.
        self.label_smoother = LabelSmoother(self.label_smoothing) if self.label_smoothing > 0 else None

    def _trainer_computes_loss(self, inputs: dict[str, Any], num_items_in_batch: Any = None) -> bool:
        """Whether compute_loss takes the labels out and computes the loss itself (also when
        the model's own loss would ignore a target count it needs)."""
        return "labels" in inputs and (
            self.compute_loss_func is not None
            or self.label_smoothing > 0
            or not self._model_takes_labels
            or (num_items_in_batch is not None and self._loss_by_kind)
        )

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """Forward pass and loss; ``num_items_in_batch`` counts targets of the whole accumulated batch.

        A loss from ``compute_loss_func`` (or the default loss given num_items_in_batch) is
        already normalized over the accumulated batch and is not divided again.
        """
        labels = None
        if self._trainer_computes_loss(inputs, num_items_in_batch):
            inputs = dict(inputs)
            labels = inputs.pop("labels")
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None and labels is None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if labels is not None:
            if self.compute_loss_func is not None:
                loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            else:
                loss = self._default_loss(outputs, labels, num_items_in_batch)
        else:
            if isinstance(outputs, torch.Tensor):
                # A bare tensor is the loss only when it is a scalar; otherwise it is logits.
                loss = outputs if outputs.dim() == 0 else None
            else:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs[0]
            if loss is None:
                keys = (", ".join(outputs) if isinstance(outputs, dict)
                        else f"a tensor of shape {tuple(outputs.shape)}" if isinstance(outputs, torch.Tensor)
                        else "a tuple")
                raise ValueError(
                    f"the model did not return a loss (it returned {keys}); pass labels in the inputs "
                    "(a 'labels' column) or a compute_loss_func"
                )
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and self.accelerator.num_processes > 1 and self._loss_is_normalized(inputs, labels)):
            # DDP averages gradients over processes; the loss was divided by the global count.
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def _default_loss(self, outputs: Any, labels: torch.Tensor, num_items: Any) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0] if isinstance(outputs, tuple) else outputs
        loss_fn = losses.LOSS_MAPPING.get(self.model_kind or "")
        if loss_fn is None:
            raise ValueError(
                f"cannot pick a default loss for {type(unwrap_model(self.model)).__name__}: "
                f"set model.loss_type to one of {', '.join(losses.LOSS_MAPPING)} or pass compute_loss_func"
            )
        return loss_fn(logits, labels, num_items_in_batch=num_items, label_smoothing=self.label_smoothing,
                       problem_type=self._problem_type)

    def _loss_is_normalized(self, inputs: dict[str, Any], labels: Any) -> bool:
        if self.compute_loss_func is not None:
            return True
        return labels is not None or (self.model_accepts_loss_kwargs and self._model_loss_counts)

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (autocast is applied by Accelerate's model wrapper)."""
        return contextlib.nullcontext()
