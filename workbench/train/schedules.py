"""Learning-rate schedules named as in transformers (``lr_scheduler_type``), built on torch.

Every step-based schedule is a ``LambdaLR`` multiplier of the base learning rate, as in HF,
so each gives HF's rate at each step and a live edit of the base rate
(``param_group["initial_lr"]`` / ``scheduler.base_lrs``, workbench/core/edits.py) rescales
the rest of it. ``reduce_lr_on_plateau`` is torch's ``ReduceLROnPlateau``, stepped after
each evaluation on ``metric_for_best_model`` (:func:`step_on_metric`), never per update.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

__all__ = ["SCHEDULES", "get_scheduler", "steps_per_update", "step_on_metric"]


def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _cosine_factor(progress: float, cycles: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress))


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    """Cosine decay after a linear warmup, down to ``min_lr_rate`` of the base rate."""
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0, _cosine_factor(progress, num_cycles) * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, *, warmup: int, total: int, num_cycles: int = 1) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(step: int, *, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7,
                power: float = 1.0) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / lr_init
    remaining = 1 - (step - warmup) / max(1, total - warmup)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, warmup: int, timescale: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


def _cosine_warmup_with_min_lr(step: int, *, warmup: int, total: int, num_cycles: float = 0.5,
                               min_lr_rate: float = 0.0, warmup_lr_rate: float | None = None) -> float:
    """As cosine_with_min_lr, but the warmup starts above 0 (at ``warmup_lr_rate``, by
    default one warmup step's worth) and the decay is counted from the step after it."""
    step, warmup, total = float(step), float(warmup), float(total)
    if step < warmup:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, warmup)
        rate = float(warmup_lr_rate)
        return rate + (1.0 - rate) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, total - warmup)
    return max(0, _cosine_factor(progress, num_cycles) * (1 - min_lr_rate) + min_lr_rate)


_SHAPES = {
    "linear": lambda p: p, "cosine": lambda p: 0.5 * (1.0 - math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(1.0 - p),
}


def _warmup_stable_decay(step: int, *, warmup: int, stable: int, decay: int, warmup_type: str, decay_type: str,
                         min_lr_ratio: float, num_cycles: float) -> float:
    """Warm up (by ``warmup_type``) from ``min_lr_ratio``, hold, then decay (by ``decay_type``)
    back to it over ``decay`` steps; ``min_lr_ratio`` after that."""
    if step < warmup:
        factor = _SHAPES[warmup_type](_warmup(step, warmup))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < warmup + stable:
        return 1.0
    if step < warmup + stable + decay:
        progress = float(step - warmup - stable) / float(max(1, decay))
        if decay_type == "linear":
            factor = 1.0 - progress
        elif decay_type == "cosine":
            factor = _cosine_factor(progress, num_cycles)
        else:  # "1-sqrt"
            factor = 1.0 - math.sqrt(progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


# The step-based schedules (HF's names); reduce_lr_on_plateau is built apart.
SCHEDULES = {
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts,
    "polynomial": _polynomial,
    "inverse_sqrt": _inverse_sqrt,
    "cosine_with_min_lr": _cosine,
    "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
    "warmup_stable_decay": _warmup_stable_decay,
}


def _min_lr_rate(kwargs: dict[str, Any], base_lr: float) -> None:
    """cosine*_with_min_lr take the floor as ``min_lr`` (absolute) or ``min_lr_rate``: exactly one."""
    min_lr, rate = kwargs.pop("min_lr", None), kwargs.get("min_lr_rate")
    if min_lr is not None and rate is not None:
        raise ValueError("give min_lr or min_lr_rate, not both")
    if min_lr is not None:
        kwargs["min_lr_rate"] = min_lr / base_lr
    elif rate is None:
        raise ValueError("this schedule needs min_lr or min_lr_rate, e.g. {\"min_lr_rate\": 0.1}")


def _bound(name: str, kwargs: dict[str, Any], base_lr: float, warmup: int, total: int) -> Any:
    """The schedule's multiplier with its step counts and kwargs bound (ValueError/TypeError on bad kwargs)."""
    fn = SCHEDULES[name]
    if name == "constant":
        if kwargs:
            raise TypeError(f"constant takes no keyword arguments, got {', '.join(kwargs)}")
        return fn
    if name == "constant_with_warmup":
        return partial(fn, warmup=warmup, **kwargs)
    if name == "inverse_sqrt":
        kwargs.setdefault("timescale", None)
        if kwargs["timescale"] is None:
            kwargs["timescale"] = warmup or 10_000
        return partial(fn, warmup=warmup, **kwargs)
    if name == "warmup_stable_decay":
        if "num_decay_steps" not in kwargs:
            raise ValueError('warmup_stable_decay needs num_decay_steps, e.g. {"num_decay_steps": 100}')
        decay = kwargs.pop("num_decay_steps")
        stable = kwargs.pop("num_stable_steps", None)
        for key, default in (("warmup_type", "linear"), ("decay_type", "cosine")):
            kind = kwargs.setdefault(key, default)
            if kind not in _SHAPES:
                raise ValueError(f"{key} {kind!r} is not one of: {', '.join(_SHAPES)}")
        kwargs.setdefault("min_lr_ratio", 0)
        kwargs.setdefault("num_cycles", 0.5)
        stable = total - warmup - decay if stable is None else stable
        return partial(fn, warmup=warmup, stable=stable, decay=decay, **kwargs)
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        _min_lr_rate(kwargs, base_lr)
    if name == "polynomial":
        kwargs.setdefault("lr_init", base_lr)
        lr_end = kwargs.get("lr_end", 1e-7)
        if not kwargs["lr_init"] > lr_end:
            raise ValueError(f"lr_end ({lr_end}) must be smaller than the learning rate ({kwargs['lr_init']})")
    return partial(fn, warmup=warmup, total=total, **kwargs)


def get_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int = 0,
    num_training_steps: int = 0,
    scheduler_specific_kwargs: dict[str, Any] | None = None,
) -> LambdaLR | ReduceLROnPlateau:
    """The named schedule on ``optimizer`` (HF's ``get_scheduler``): a LambdaLR stepped once
    per update, or for ``reduce_lr_on_plateau`` a ReduceLROnPlateau stepped per evaluation.

    ``scheduler_specific_kwargs`` are ``lr_scheduler_kwargs``; ValueError with one line
    ("lr_scheduler_kwargs: ...") when they do not fit the schedule.
    """
    name = getattr(name, "value", name)
    kwargs = dict(scheduler_specific_kwargs or {})
    if name == "reduce_lr_on_plateau":
        try:
            scheduler = ReduceLROnPlateau(optimizer, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"lr_scheduler_kwargs: {exc}") from None
        # The rates a live edit rescales (as a LambdaLR's), saved with the scheduler's state.
        scheduler.base_lrs = [group["lr"] for group in optimizer.param_groups]
        return scheduler
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type: {name!r} is not one of: {', '.join([*SCHEDULES, 'reduce_lr_on_plateau'])}")
    try:
        bound = _bound(name, kwargs, optimizer.defaults["lr"], num_warmup_steps, num_training_steps)
        bound(0)
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"lr_scheduler_kwargs: {exc}") from None
    return LambdaLR(optimizer, bound)


def steps_per_update(scheduler: Any) -> bool:
    """Whether the training loop steps ``scheduler`` after each update (not a plateau one)."""
    return not isinstance(scheduler, ReduceLROnPlateau)


def step_on_metric(scheduler: Any, metric_for_best_model: str | None, metrics: dict[str, float]) -> None:
    """After an evaluation during training: step a plateau schedule on the evaluated
    ``metric_for_best_model`` (with or without its ``eval_`` prefix), as HF does."""
    if steps_per_update(scheduler) or any(k.endswith("_interrupted") for k in metrics):
        return  # an evaluation a stop cut short does not count (as for the best metric)
    key = metric_for_best_model if metric_for_best_model.startswith("eval_") else f"eval_{metric_for_best_model}"
    if key not in metrics:
        raise KeyError(f"metric_for_best_model: reduce_lr_on_plateau steps on {key!r}, which the evaluation did not "
                       f"return (it returned: {', '.join(sorted(metrics))}); set metric_for_best_model to one of these")
    scheduler.step(metrics[key])
