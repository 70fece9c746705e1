"""Agreement of the guard's per-step flags across ranks (issue #18): every rank skips the
same step.

A step's two flags (non-finite loss or gradient norm, loss spike) are per rank, yet the skip
must happen on every rank or the replicas drift apart; and it must be decided at that very
step, before the optimizer step. So the flags get one MAX all-reduce of their own per step,
on the default group, right before the optimizer step (:func:`all_reduce_flags`).

- **GPUs (NCCL)**: the all-reduce is ordered on the device stream; the host never waits,
  and the agreed flag reaches the fused optimizer's ``found_inf`` on the device. No per-step
  host sync (no host sync per step: docs/architecture.md).
- **CPU ranks (gloo)**: the all-reduce blocks the host, right after the gradients'
  all-reduce and the clipping, when the ranks are aligned anyway. Measured on 2 CPU ranks
  (benchmarks/guard_overhead.py --processes 2, MLP, 2 cores shared with other jobs, load
  3-8): guard on vs off 0.80-0.99 of steps/s across five runs, against 0.97 and 1.05 for
  the guard with the agreement left out; so the agreement is most of the cost there, and it
  varies with the machine's load (a collective waits for the slower rank). The alternative, the flags
  folded into DDP's own gradient all-reduce through a communication hook (commit 2f38274),
  measured no better side by side (fold 0.94 / 0.96 / 0.82 / 0.83 vs this 0.95 / 0.99 /
  0.80 / 0.80) while replacing DDP's built-in C++ all-reduce by a Python hook and needing
  the loss before the backward; so the simpler design stays. Starting this all-reduce
  asynchronously does not help either: nothing is left to overlap between the gradient
  norm and the optimizer step.

The control exchange (rank_sync.py) is not used for this: it runs every few steps and on
the host, while a skip has to be agreed at the very step it concerns. Rollback, pause and
stop need no exchange of their own: they are decided at logging points from the agreed
flags, which every rank reads at the same step, so every rank takes the same action.
"""

from __future__ import annotations

import torch

__all__ = ["all_reduce_flags"]


def all_reduce_flags(flags: torch.Tensor) -> None:
    """MAX all-reduce of a step's flags in place on the default group (NCCL: no host sync)."""
    import torch.distributed as dist

    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
