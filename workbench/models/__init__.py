"""Built-in models that need no download: the demo and tests train these.

Kept import-light (torch only) because the CLI imports it to list choices.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from workbench.models.mlp import MLPClassifier
from workbench.models.tiny_gpt import TinyGPT

__all__ = ["BUILTIN_MODELS", "MLPClassifier", "TinyGPT", "build_builtin_model"]

BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {
    "tiny-gpt": TinyGPT,
    "mlp": MLPClassifier,
}


def _accepted_options(factory: Callable[..., nn.Module]) -> list[str]:
    params = inspect.signature(factory).parameters.values()
    return [p.name for p in params
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def build_builtin_model(name: str, **options: Any) -> nn.Module:
    """Construct the built-in model ``name`` with constructor ``options``.

    Names and options usually come from a config file or the command line, so mistakes are
    reported as ``ValueError`` listing the valid choices rather than a bare ``TypeError``.
    """
    try:
        factory = BUILTIN_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown builtin model {name!r}; choose one of: {', '.join(sorted(BUILTIN_MODELS))}"
        ) from None
    accepted = _accepted_options(factory)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) for builtin model {name!r}: {', '.join(unknown)}; "
            f"accepted options: {', '.join(accepted)}"
        )
    return factory(**options)
