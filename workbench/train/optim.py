"""Optimizers named as in transformers (``optim``), built from torch; the learning-rate
schedules are in schedules.py (``get_scheduler`` and ``SCHEDULES`` are re-exported here).

torch builds adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop and adafactor; the
other names transformers lists need packages, and TrainingArguments refuses them with the
package to install (workbench/core/args/enums.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from workbench.core.args.enums import SERVED_OPTIMIZERS, OptimizerNames, unserved_optimizer
from workbench.core.args.training import TrainingArguments
from workbench.core.trainer_utils import unwrap_model
from workbench.models.param_groups import decay_parameter_names, parameter_groups  # noqa: F401 - part of this module's API
from workbench.train.schedules import SCHEDULES, get_scheduler  # noqa: F401 - part of this module's API

__all__ = [
    "TrainerOptimizer",
    "decay_parameter_names",
    "parameter_groups",
    "get_optimizer_cls_and_kwargs",
    "get_scheduler",
    "SCHEDULES",
]

def _parse_optim_args(text: str | None) -> dict[str, Any]:
    """HF's optim_args: "key=value,key=value"; numbers and booleans are converted."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"optim_args: {item!r} must look like key=value")
        key, value = item.split("=", 1)
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[key] = lowered == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


def get_optimizer_cls_and_kwargs(args: TrainingArguments) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and keyword arguments for ``args.optim`` (HF's static method).

    ``optim_args`` ("key=value,...") are passed to the class as keyword arguments, numbers
    and booleans converted; the Adam betas and epsilon apply to adamw_torch(_fused).
    """
    extra = _parse_optim_args(args.optim_args)
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    name = OptimizerNames(args.optim)
    if name in (OptimizerNames.ADAMW_TORCH, OptimizerNames.ADAMW_TORCH_FUSED):
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        if name is OptimizerNames.ADAMW_TORCH_FUSED:
            kwargs["fused"] = True
        return torch.optim.AdamW, {**kwargs, **extra}
    classes = {OptimizerNames.SGD: torch.optim.SGD, OptimizerNames.ADAGRAD: torch.optim.Adagrad,
               OptimizerNames.RMSPROP: torch.optim.RMSprop, OptimizerNames.ADAFACTOR: torch.optim.Adafactor}
    if name in classes:
        return classes[name], {**kwargs, **extra}
    raise ValueError(f"optim: {unserved_optimizer(name) or ', '.join(SERVED_OPTIMIZERS)}")


def trainable_parameters(params: Iterable[torch.nn.Parameter]) -> int:
    """Number of elements in the parameters that require grad."""
    return sum(p.numel() for p in params if p.requires_grad)


class TrainerOptimizer:
    """The Trainer's optimizer and schedule, HF's override points (mixed into ``Trainer``)."""

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Parameters that get weight decay (not biases, not norm weights)."""
        return sorted(decay_parameter_names(model))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer from ``args.optim`` (or optimizer_cls_and_kwargs), decay groups applied.

        ``model`` (HF's signature) optimizes another module than the Trainer's.
        """
        if self.optimizer is None:
            model = unwrap_model(model if model is not None else self.model)
            groups = parameter_groups(model, self.args.weight_decay)
            cls, kwargs = self.optimizer_cls_and_kwargs or get_optimizer_cls_and_kwargs(self.args)
            self.optimizer = cls(groups, **kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The LR schedule from ``args.lr_scheduler_type`` over ``num_training_steps``."""
        if self.lr_scheduler is None:
            self.lr_scheduler = get_scheduler(
                self.args.lr_scheduler_type,
                optimizer if optimizer is not None else self.optimizer,
                num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps,
                scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Create both (HF order: optimizer first, schedule on it)."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)

    def get_learning_rates(self) -> list[float]:
        """Current learning rate of each parameter group."""
        if self.lr_scheduler is not None:
            return list(self.lr_scheduler.get_last_lr())
        if self.optimizer is None:
            raise ValueError("the optimizer is not created yet: call train() or create_optimizer() first")
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_num_trainable_parameters(self) -> int:
        """Number of parameter elements that require grad."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)
