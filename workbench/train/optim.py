"""Optimizers and learning-rate schedules named as in transformers, built from torch.

Schedules are ``LambdaLR`` multipliers of the base learning rate (what HF does), so a live
edit of the base rate (``param_group["initial_lr"]``) rescales the rest of the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from workbench.train.args import OptimizerNames, TrainingArguments

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
    """The optimizer class and keyword arguments for ``args.optim`` (HF's static method)."""
    extra = _parse_optim_args(args.optim_args)
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    name = OptimizerNames(args.optim)
    if name in (OptimizerNames.ADAMW_TORCH, OptimizerNames.ADAMW_TORCH_FUSED):
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        if name is OptimizerNames.ADAMW_TORCH_FUSED:
            kwargs["fused"] = True
        return torch.optim.AdamW, {**kwargs, **extra}
    if name is OptimizerNames.SGD:
        return torch.optim.SGD, {**kwargs, **extra}
    if name is OptimizerNames.ADAFACTOR:
        return torch.optim.Adafactor, {**kwargs, **extra}
    raise ValueError(f"optim: {args.optim!r} is not one of: {', '.join(o.value for o in OptimizerNames)}")


# -- schedules: multipliers of the base learning rate, as functions of the step ---------


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float = 0.5) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))


def _cosine_with_restarts(step: int, *, warmup: int, total: int, num_cycles: int = 1) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step: int, *, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7,
                power: float = 1.0) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if step > total:
        return lr_end / lr_init
    decay_steps = total - warmup
    remaining = 1 - (step - warmup) / max(1, decay_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


SCHEDULES = {
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts,
    "polynomial": _polynomial,
}


def get_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int = 0,
    num_training_steps: int = 0,
    scheduler_specific_kwargs: dict[str, Any] | None = None,
) -> LambdaLR:
    """A LambdaLR for the named schedule (HF's ``get_scheduler``), stepped once per update."""
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type: {name!r} is not one of: {', '.join(SCHEDULES)}")
    kwargs = dict(scheduler_specific_kwargs or {})
    fn = SCHEDULES[name]
    if name == "constant":
        bound = fn
    elif name == "constant_with_warmup":
        bound = partial(fn, warmup=num_warmup_steps)
    else:
        if name == "polynomial":
            kwargs.setdefault("lr_init", optimizer.defaults["lr"])
            if kwargs["lr_init"] <= kwargs.get("lr_end", 1e-7):
                raise ValueError(
                    f"lr_scheduler_kwargs: lr_end ({kwargs.get('lr_end', 1e-7)}) must be smaller than "
                    f"the learning rate ({kwargs['lr_init']})"
                )
        try:
            bound = partial(fn, warmup=num_warmup_steps, total=num_training_steps, **kwargs)
            bound(0)
        except TypeError as exc:
            raise ValueError(f"lr_scheduler_kwargs: {exc}") from None
    return LambdaLR(optimizer, bound)


def trainable_parameters(params: Iterable[torch.nn.Parameter]) -> int:
    """Number of elements in the parameters that require grad."""
    return sum(p.numel() for p in params if p.requires_grad)
