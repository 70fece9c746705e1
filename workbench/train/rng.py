"""Every random stream a run draws from (Python, NumPy, torch CPU and CUDA), captured and
restored in one place: checkpoints store it, and anything done on a paused run runs inside
:func:`rng_preserved`, so a resumed or paused run stays bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "rng_preserved", "numpy_safe_globals"]


def capture_rng(all_devices: bool = False) -> dict[str, Any]:
    """The RNG states in transformers' rng_state.pth layout (so either Trainer resumes from the
    other's checkpoints): CUDA's current device, or every device's with ``all_devices``
    (several processes), as HF does. Loads with :func:`load_rng` (weights_only)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all() if all_devices else torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` took, or a file of an older layout (NumPy's state as
    tensors); CUDA states only where CUDA is present."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    if isinstance(n, dict):  # workbench's first layout
        n = ("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(tuple(n))
    torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda)


def numpy_safe_globals() -> Any:
    """``torch.serialization.safe_globals`` for NumPy's RNG state: arrays and dtypes only, so
    ``torch.load(weights_only=True)`` reads HF's rng_state.pth and still runs no code."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    return torch.serialization.safe_globals(allowed)


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Run a block (an evaluation, an inspection, a save on a paused run) and leave every RNG
    stream as it was before it."""
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)
