"""How far a run is and how fast it goes: elapsed time, steps/samples/tokens per second, ETA.

Computed from the TrainerState and the clock when a snapshot is published (at most ten
times a second), never per step. Tokens are the non-padding tokens the run's Throughput
counts (train/throughput.py, the ``train_tokens_per_second`` of the logs): samples/s times
its non-padding tokens a sample, so the live figure and the logged one count alike. Time spent paused is not training time: the Session's
:class:`PauseClock` stops while the run is paused, so elapsed time neither runs on during a
pause nor jumps back after it, samples/s does not decay while paused, and the paused time
is shown apart (``Snapshot.paused``).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["progress", "PauseClock"]


class PauseClock:
    """A clock of training time: ``perf_counter`` with the time spent paused taken out.

    The thread that holds the loop calls :meth:`begin` when a pause starts and :meth:`end`
    when it ends; any thread reads :meth:`now` (frozen while paused) and :meth:`paused`."""

    def __init__(self) -> None:
        self.since: float | None = None  # perf_counter() when the pause under way began
        self.total = 0.0  # seconds of the pauses that have ended

    def begin(self) -> None:
        """A pause starts now."""
        if self.since is None:
            self.since = time.perf_counter()

    def end(self) -> None:
        """The pause under way ends now."""
        since, self.since = self.since, None
        if since is not None:
            self.total += time.perf_counter() - since

    def now(self) -> float:
        """Training time in seconds (an arbitrary origin, like perf_counter): stands still while paused."""
        since = self.since
        return (since if since is not None else time.perf_counter()) - self.total

    def paused(self) -> float:
        """Seconds spent paused, the pause under way included."""
        since = self.since
        return self.total + (time.perf_counter() - since if since is not None else 0.0)


def progress(trainer: Any, started_at: float | None, start_step: int, clock: PauseClock | None = None) -> dict[str, Any]:
    """Snapshot fields: elapsed (training time, from ``clock`` when given), paused time,
    steps/samples/tokens per second and ETA (None when unknown)."""
    state, args = trainer.state, trainer.args
    now = clock.now() if clock is not None else time.perf_counter()
    elapsed = now - started_at if started_at is not None else 0.0
    done = state.global_step - start_step
    steps_per_s = done / elapsed if elapsed > 0 and done > 0 else 0.0
    samples_per_step = ((state.train_batch_size or args.per_device_train_batch_size)
                        * args.gradient_accumulation_steps * trainer.accelerator.num_processes)
    # None until the run has counted tokens (a model without input ids never does).
    per_sample = getattr(getattr(trainer, "throughput", None), "tokens_per_sample", None)
    tokens_per_s = steps_per_s * samples_per_step * per_sample if per_sample is not None else None
    remaining = max(state.max_steps - state.global_step, 0)
    return {"elapsed": elapsed, "paused": clock.paused() if clock is not None else 0.0, "steps_per_second": steps_per_s, "samples_per_second": steps_per_s * samples_per_step,
            "tokens_per_second": tokens_per_s, "eta": remaining / steps_per_s if steps_per_s > 0 else None}
