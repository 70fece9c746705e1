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

__all__ = ["capture_rng", "restore_rng", "rng_preserved", "numpy_safe_globals", "CollationRng", "draws_random",
           "PENDING_KEY"]


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


# -- draws made while batches are collated ahead of training -------------------------------

#: The key of a checkpoint's RNG file that holds the streams of batches collated but not yet
#: trained (transformers' Trainer ignores keys it does not know, so it still resumes).
PENDING_KEY = "workbench_pending_batches"

# Collators known to draw nothing from the global streams: tracking them would only cost time.
_DETERMINISTIC = {
    "workbench.data.collators.default_data_collator",
    "workbench.data.collators.DataCollatorWithPadding",
    "workbench.data.collators.DataCollatorForSeq2Seq",
    "workbench.data.collators.DataCollatorForTokenClassification",
    "workbench.data.collators.DataCollatorForLanguageModeling",  # seeded per (seed, epoch, ids)
    "transformers.data.data_collator.default_data_collator",
    "transformers.data.data_collator.DefaultDataCollator",
    "transformers.data.data_collator.DataCollatorWithPadding",
    "transformers.data.data_collator.DataCollatorForSeq2Seq",
    "transformers.data.data_collator.DataCollatorForTokenClassification",
    "transformers.data.data_collator.DataCollatorForMultipleChoice",
}


def _host_streams() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_host_streams(streams: tuple[Any, Any, torch.Tensor] | dict[str, Any]) -> None:
    if isinstance(streams, dict):
        streams = (streams["python"], streams["numpy"], streams["cpu"])
    python, numpy_state, cpu = streams
    version, internal, gauss = python
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(numpy_state))
    torch.set_rng_state(cpu)


def draws_random(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` may draw from the global random streams (unknown ones may)."""
    inner = getattr(collate_fn, "collator", collate_fn)  # inside workbench's column-removing wrapper
    if getattr(inner, "generator", None) is not None or getattr(inner, "seed", None) is not None:
        return False  # transformers' masking collators with a seed draw from their own generator
    candidates = {f"{getattr(inner, '__module__', '')}.{getattr(inner, '__qualname__', '')}",
                  f"{type(inner).__module__}.{type(inner).__qualname__}"}
    return not candidates & _DETERMINISTIC


class CollationRng:
    """A train loader's ``collate_fn`` that remembers the host random streams (Python, NumPy,
    torch CPU) before each batch it collates, so a checkpoint can replay them.

    Accelerate's loaders collate one batch ahead of the one they hand out, and a step that is
    stopped before it trains has fetched its micro-batches already: when a checkpoint is
    written, batches may be collated whose random draws (an MLM collator's masking) were made
    before the step's dropout, evaluation and save. A run resumed from it collates those
    batches again; :meth:`replay` has each drawn from the streams the original run drew it
    from, then puts back the streams the checkpoint restored, so the resumed run masks and
    drops out exactly as the uninterrupted one. One capture per batch (~60 us, NumPy's share
    the largest); only for collators that may draw (:func:`draws_random`) in the main process.
    """

    def __init__(self, collate_fn: Any, keep: int) -> None:
        self.collate_fn = collate_fn
        self._keep = keep
        self._before: list[tuple[Any, Any, torch.Tensor]] = []  # the newest `keep` batches' streams
        self.calls = 0  # batches collated since the iterator started
        self._replay: list[Any] = []
        self._after: Any = None

    def __getattr__(self, name: str) -> Any:  # set_epoch and the like reach the collator itself
        return getattr(self.__dict__["collate_fn"], name)

    def __call__(self, features: Any) -> Any:
        if self._replay:
            if self._after is None:
                self._after = _host_streams()
            _set_host_streams(self._replay.pop(0))
            try:
                return self._collate(features)
            finally:
                if not self._replay:
                    _set_host_streams(self._after)
                    self._after = None
        return self._collate(features)

    def _collate(self, features: Any) -> Any:
        self._before.append(_host_streams())
        del self._before[:-self._keep]
        self.calls += 1
        return self.collate_fn(features)

    def restart(self) -> None:
        """A new iterator starts (an epoch, a resume, a rollback): nothing is collated ahead."""
        self._before.clear()
        self.calls = 0

    def pending(self, trained: int) -> list[dict[str, Any]]:
        """The streams of the batches collated but not trained (``trained`` of this
        iterator's batches were), oldest first, for a checkpoint's RNG file."""
        count = min(self.calls - trained, len(self._before))
        rows = self._before[len(self._before) - count:] if count > 0 else []
        return [{"python": p, "numpy": n, "cpu": c} for p, n, c in rows]

    def replay(self, streams: list[dict[str, Any]]) -> None:
        """Draw the next ``len(streams)`` batches from these streams (a checkpoint's pending
        batches), then go on from the streams current when the first of them is collated."""
        self._replay = list(streams)
        self._after = None
