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

__all__ = ["capture_rng", "restore_rng", "rng_preserved"]


def capture_rng() -> dict[str, Any]:
    """The RNG states as tensors and plain values (loadable with ``torch.load(weights_only=True)``)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` took (CUDA states only where CUDA is present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Run a block (an evaluation, an inspection, a save on a paused run) and leave every RNG
    stream as it was before it."""
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)
