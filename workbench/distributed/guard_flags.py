"""Agreement of the guard's per-step flags across ranks (issue #18): every rank skips the
same step, decided without a host sync on the GPU and without an extra collective per step
on CPU ranks.

A step's two flags (non-finite loss, loss spike) are per rank, yet the skip must happen
on every rank or the replicas drift apart. Two ways, chosen by the process group's backend:

- **NCCL (GPUs)**: one MAX all-reduce of the two flags per step, right before the
  optimizer step (:func:`all_reduce_flags`). NCCL orders it on the device stream, so the
  host never waits and the flag reaches the fused optimizer's ``found_inf`` on the device.
- **gloo (CPU ranks)**: the flags ride in DDP's own gradient all-reduce
  (:class:`FlagsInGradients`, a DDP communication hook that appends them to one bucket).
  Measured on 2 CPU ranks (benchmarks/guard_overhead.py --processes 2): a separate gloo
  all-reduce per step, even of two numbers, cost 16% of steps/s on the MLP (every
  collective waits for the slower rank and gloo's thread busy-waits), and starting it
  asynchronously does not help because nothing is left to overlap between the gradient
  norm and the optimizer step. Folded into the gradient all-reduce it costs a copy of two
  numbers. The gradient norm needs no agreement: it is computed from the all-reduced
  gradients, the same on every rank.

The control exchange (rank_sync.py) is not used for this: it runs every few steps and on the
host, while a skip has to be agreed at the very step it concerns. Rollback, pause and stop
need no exchange of their own either: they are decided at logging points from these agreed
flags, which every rank reads at the same step.

The gradients stay what DDP's default hook makes them (divided by the world size, then
summed); a flag is summed the same way and read as "any rank > 0".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["all_reduce_flags", "FlagsInGradients", "folds_into_gradients"]


def all_reduce_flags(flags: torch.Tensor) -> None:
    """MAX all-reduce of a step's flags in place on the default group (NCCL: no host sync)."""
    import torch.distributed as dist

    dist.all_reduce(flags, op=dist.ReduceOp.MAX)


def folds_into_gradients(model: torch.nn.Module) -> bool:
    """Whether the flags can ride in ``model``'s gradient all-reduce: a torch DDP model on a
    gloo group (on NCCL a separate all-reduce is cheap and stream-ordered)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    return dist.get_backend(model.process_group) == "gloo"


class FlagsInGradients:
    """A DDP communication hook that all-reduces the guard's flags with the first gradient
    bucket of each synchronizing backward.

    ``local_flags`` is called from the hook (after the forward, during the backward) and
    returns this rank's two flags (float 0/1); the agreed flags (1.0 where any rank set one)
    land in ``agreed`` before the backward returns, as DDP waits for its buckets.
    One hook per DDP model: a later monitor (a new ``train()`` on the same wrapped model)
    takes over the installed one; a model with a hook of someone else's raises RuntimeError
    (the caller then agrees with :func:`all_reduce_flags`).
    """

    def __init__(self, model: torch.nn.Module, local_flags: Callable[[], torch.Tensor]) -> None:
        self.local_flags = local_flags
        self.agreed = torch.zeros(2, dtype=torch.float32)
        installed = getattr(model, "_workbench_guard_flags", None)
        if installed is not None:
            installed.local_flags, installed.agreed = local_flags, self.agreed
            return
        self._group = model.process_group
        model.register_comm_hook(state=None, hook=self._hook)  # RuntimeError when one is there
        model._workbench_guard_flags = self

    # No annotations: DDP accepts a hook only if they are missing or the real GradBucket and
    # Future classes, and this module's annotations are strings.
    def _hook(self, state, bucket):
        import torch.distributed as dist

        group, world = self._group, self._group.size()
        buffer = bucket.buffer()
        if bucket.index() != 0:  # DDP's default hook: divide, then sum
            buffer.div_(world)
            future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
            return future.then(lambda done: done.value()[0])
        size = buffer.numel()
        joined = torch.cat([buffer, self.local_flags().to(buffer.dtype)])
        joined.div_(world)
        future = dist.all_reduce(joined, group=group, async_op=True).get_future()
        agreed = self.agreed

        def split(done: torch.futures.Future) -> torch.Tensor:
            reduced = done.value()[0]
            torch.gt(reduced[size:], 0, out=agreed)  # the sum of flags / world: > 0 when any rank set one
            return reduced[:size]

        return future.then(split)
