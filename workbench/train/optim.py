"""Optimizers named as in transformers (``optim``), built from torch; the learning-rate
schedules are in schedules.py (``get_scheduler`` and ``SCHEDULES`` are re-exported here).

torch builds adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop and adafactor; the
other names transformers lists need packages, and TrainingArguments refuses them with the
package to install (workbench/train/arg_enums.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from workbench.train.arg_enums import SERVED_OPTIMIZERS, OptimizerNames, unserved_optimizer
from workbench.train.args import TrainingArguments
from workbench.train.schedules import SCHEDULES, get_scheduler  # noqa: F401 - part of this module's API

__all__ = [
    "decay_parameter_names",
    "parameter_groups",
    "get_optimizer_cls_and_kwargs",
    "get_scheduler",
    "SCHEDULES",
]

_NORM_TYPES = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of parameters that get weight decay: everything but biases and norm weights.

    Norm layers are found by type (torch's norms) and by name ("norm" in the module class
    name, which covers RMSNorm variants of other libraries).
    """
    skip: set[str] = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if is_norm or param_name == "bias":
                skip.add(full)
    return {name for name, _ in model.named_parameters() if name not in skip}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups, with and without weight decay; frozen parameters left out.

    Without weight decay the two would be identical, so they are one group (a fused
    optimizer then launches its kernels once per step, not twice). The parameter order is
    the same either way, so saved optimizer states convert between the layouts.
    """
    decay = decay_parameter_names(model)
    with_decay, without = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (with_decay if name in decay else without).append(param)
    if weight_decay == 0:
        return [{"params": with_decay + without, "weight_decay": 0.0}] if with_decay or without else []
    groups = [{"params": with_decay, "weight_decay": weight_decay},
              {"params": without, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


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
