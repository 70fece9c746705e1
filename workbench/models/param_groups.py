"""Which parameters get weight decay, and HF's two optimizer groups (with and without it):
the Trainer builds its optimizer from them (train/optim.py), and checkpoints are written in
that layout so either Trainer resumes from the other's (checkpoint/trainer_state.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["decay_parameter_names", "parameter_groups"]

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
