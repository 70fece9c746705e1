"""How far a run is and how fast it goes: elapsed time, steps/samples/tokens per second, ETA.

Computed from the TrainerState and the clock when a snapshot is published (at most ten
times a second), never per step. Time spent paused is taken out of ``started_at`` by the
Session, so speeds and the ETA stay honest across pauses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

__all__ = ["progress"]


def progress(trainer: Any, started_at: float | None, start_step: int) -> dict[str, Any]:
    """Snapshot fields: elapsed, steps/samples/tokens per second and ETA (None when unknown)."""
    state, args = trainer.state, trainer.args
    elapsed = time.perf_counter() - started_at if started_at is not None else 0.0
    done = state.global_step - start_step
    steps_per_s = done / elapsed if elapsed > 0 and done > 0 else 0.0
    samples_per_step = ((state.train_batch_size or args.per_device_train_batch_size)
                        * args.gradient_accumulation_steps * trainer.accelerator.num_processes)
    tokens_per_s = None
    batch = getattr(trainer, "last_inputs", None)
    # Any Mapping is a batch (HF's collators return BatchEncoding, a UserDict).
    if isinstance(batch, Mapping) and hasattr(batch.get("input_ids"), "shape") and batch["input_ids"].dim() == 2:
        tokens_per_s = steps_per_s * samples_per_step * batch["input_ids"].shape[1]
    remaining = max(state.max_steps - state.global_step, 0)
    return {"elapsed": elapsed, "steps_per_second": steps_per_s, "samples_per_second": steps_per_s * samples_per_step,
            "tokens_per_second": tokens_per_s, "eta": remaining / steps_per_s if steps_per_s > 0 else None}
