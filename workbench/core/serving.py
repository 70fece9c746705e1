"""The hook through which ``Trainer.train()`` serves a control endpoint (``control = true``).

The endpoint belongs to the session layer (workbench.session, workbench.control), which the
training layer never imports (it is above it). So the slot lives here, in the bottom layer
both see: the Trainer calls it, and the package's facade fills it with the session layer's
runner:
``workbench/__init__.py`` registers the runner, and Python runs that package file before
any ``workbench.*`` module, so every way of importing the Trainer has it. A Trainer
trained by a Session (``trainer.control_owner`` set) leaves the endpoint to that Session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register_control_runner", "control_runner"]

# runner(trainer, resume_from_checkpoint=..., trial=..., ignore_keys_for_eval=...) -> TrainOutput:
# trains in the caller's thread while serving the endpoint.
_runner: Callable[..., Any] | None = None


def register_control_runner(runner: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Install the function that trains with an endpoint (None removes it); returns the previous one."""
    global _runner
    previous, _runner = _runner, runner
    return previous


def control_runner() -> Callable[..., Any]:
    """The registered runner; RuntimeError (one line) when none is, which only a partial install causes."""
    if _runner is None:
        raise RuntimeError("control = true: no control runner is registered (import workbench first, "
                           "or set control = false)")
    return _runner
