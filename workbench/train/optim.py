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

from workbench.core.args.enums import SERVED_OPTIMIZERS, OptimizerNames, unserved_optimizer
from workbench.core.args.training import TrainingArguments
from workbench.models.param_groups import decay_parameter_names, parameter_groups  # noqa: F401 - part of this module's API
from workbench.train.schedules import SCHEDULES, get_scheduler  # noqa: F401 - part of this module's API

__all__ = [
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
