"""NEFTune: uniform noise on the input embeddings while training (``neftune_noise_alpha``).

The noise is added by a forward hook on ``model.get_input_embeddings()``, as in HF: each
element gets ``U(-m, m)`` with ``m = alpha / sqrt(L * d)`` (``L`` the sequence length, ``d`` the
embedding width), only while the embedding module is in training mode -- evaluation,
prediction and sampling (``model.eval()``) see the plain embeddings. The hook is removed
when training ends, leaving the model exactly as it was. Noise comes from torch's global
RNG, whose state checkpoints save, so a resumed run draws the same noise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["NEFTuneHandle", "activate_neftune", "neftune_forward_hook"]


def neftune_forward_hook(alpha: float):
    """A forward hook that adds NEFTune noise of strength ``alpha`` to an embedding's output."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training or output.dim() < 2:
            return output
        dims = output.size(-2) * output.size(-1)
        magnitude = alpha / math.sqrt(dims)
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return hook


class NEFTuneHandle:
    """What :func:`activate_neftune` returns: ``remove()`` restores the original behaviour."""

    def __init__(self, module: nn.Module, alpha: float) -> None:
        self.module = module
        self.alpha = alpha
        self._handle = module.register_forward_hook(neftune_forward_hook(alpha))

    @property
    def active(self) -> bool:
        """Whether the hook is still registered."""
        return self._handle is not None

    def remove(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def activate_neftune(model: nn.Module, alpha: float) -> NEFTuneHandle:
    """Hook NEFTune noise into ``model``'s input embeddings; works for any model that has
    ``get_input_embeddings()`` (the built-in TinyGPT, transformers models, PEFT wrappers)."""
    if alpha is None or alpha <= 0:
        raise ValueError(f"neftune_noise_alpha must be > 0, got {alpha!r}")
    unwrapped = getattr(model, "module", model) if not hasattr(model, "get_input_embeddings") else model
    get = getattr(unwrapped, "get_input_embeddings", None)
    if not callable(get):
        raise ValueError(
            f"neftune_noise_alpha: {type(unwrapped).__name__} has no get_input_embeddings(), so there are "
            "no input embeddings to add noise to; add that method or unset neftune_noise_alpha"
        )
    embeddings = get()
    if not isinstance(embeddings, nn.Module):
        raise ValueError(f"neftune_noise_alpha: get_input_embeddings() returned {type(embeddings).__name__}, "
                         "not a module")
    return NEFTuneHandle(embeddings, float(alpha))
