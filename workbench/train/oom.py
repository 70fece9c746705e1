"""Out of memory, recovered in place: the step is redone with each micro-batch cut in half
and twice the accumulation, so the effective batch, the learning rate and the data order
stay what they were.

An out-of-memory error in forward or backward (``torch.OutOfMemoryError``) leaves the
step's gradients half made: they are dropped, the allocator's cache is emptied, and every
micro-batch of the step (and of every later step) is split into ``split`` equal parts along
its first dimension, trained one after another with ``split`` times the accumulation. The
change is recorded as a live edit (``micro_batch_split``, with the memory figures), which a
checkpoint carries and a resume puts back. After ``oom_retries`` recoveries, or when a
micro-batch cannot be cut further, the run stops with a checkpoint and says why. An
evaluation batch that does not fit is cut in half the same way, for evaluation only.

With several DDP ranks, one rank's error is everyone's: that rank flags it and joins the rest
of the step's collectives, every rank reads the flag after the gradients' all-reduce, and
all of them cut and redo the step alike (distributed/oom_flags.py).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from workbench.distributed.oom_flags import OomFlags, rendezvous_store

__all__ = ["OomRecovery", "split_batch", "batch_rows", "is_out_of_memory", "free_memory", "oom_flags"]

log = logging.getLogger("workbench")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory (torch's own error type)."""
    return isinstance(error, torch.OutOfMemoryError)


def batch_rows(inputs: Any) -> int:
    """Rows of a batch: the first dimension of its first tensor (0 when it has none)."""
    if isinstance(inputs, Mapping):
        inputs = next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None)
    elif isinstance(inputs, (list, tuple)):
        inputs = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
    return int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) and inputs.dim() else 0


def split_batch(inputs: Any, parts: int) -> list[Any]:
    """``inputs`` cut into ``parts`` pieces along the first dimension (tensors only; other
    values repeated), in order: the pieces together are the batch."""
    if parts == 1:
        return [inputs]
    rows = batch_rows(inputs)

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return list(torch.tensor_split(value, parts, dim=0))
        return [value] * parts

    if isinstance(inputs, Mapping):
        columns = {k: cut(v) for k, v in inputs.items()}
        pieces = [{k: columns[k][i] for k in columns} for i in range(parts)]
        return [type(inputs)(piece) if type(inputs) is not dict and _rebuildable(inputs) else piece
                for piece in pieces]
    if isinstance(inputs, (list, tuple)):
        columns = [cut(v) for v in inputs]
        return [type(inputs)(c[i] for c in columns) for i in range(parts)]
    return cut(inputs)


def _rebuildable(inputs: Any) -> bool:
    try:
        type(inputs)({})
    except Exception:  # noqa: BLE001 - a mapping type that cannot be made from a dict stays a dict
        return False
    return True


class OomRecovery:
    """The loop's out-of-memory policy: how many parts each micro-batch is cut into now."""

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.split = 1
        self.recovered = 0

    def restore(self, live_edits: list[dict[str, Any]]) -> None:
        """A resumed run cuts its micro-batches as the saved run last did."""
        for edit in live_edits:
            if "micro_batch_split" in edit:
                self.split = int(edit["micro_batch_split"])

    def pieces(self, micro: list[Any]) -> list[Any]:
        """The micro-batches of a step as trained now (each cut into ``split`` parts)."""
        if self.split == 1:
            return micro
        return [piece for inputs in micro for piece in split_batch(inputs, self.split)]

    def recover(self, run: Any, micro: list[Any], where: str) -> str | None:
        """After an out-of-memory error (``where``: the phase, and the rank with several): free
        what the failed step held and cut the micro-batches in two (recorded as a live edit).
        Returns None to redo the step, or why the run must stop instead (no retries left, or
        batches of one row). Every rank decides alike from the same counts."""
        free_memory(run)
        rows = min((batch_rows(m) for m in micro), default=0)
        if self.recovered >= self.retries:
            return (f"out of memory in {where} again after {self.recovered} recoveries (oom_retries = "
                    f"{self.retries}); lower per_device_train_batch_size or the sequence length")
        if rows // (self.split * 2) < 1:
            return (f"out of memory in {where} with micro-batches of {max(rows // self.split, 1)} row(s): nothing "
                    "left to cut; lower the sequence length or use a device with more memory")
        self.split *= 2
        self.recovered += 1
        args = run.args
        run.current_gradient_accumulation_steps = args.gradient_accumulation_steps * self.split
        memory = _memory_figures(run.accelerator.device)
        record = {"step": run.state.global_step, "time": time.time(), "micro_batch_split": self.split,
                  "reason": (f"out of memory in {where}: micro-batch {rows} -> {rows // self.split} rows, "
                             f"gradient accumulation {args.gradient_accumulation_steps * self.split // 2} -> "
                             f"{args.gradient_accumulation_steps * self.split}" + (f" ({memory})" if memory else ""))}
        run.workbench_state.live_edits.append(record)
        log.warning("step %d: %s; the step is redone", run.state.global_step + 1, record["reason"])
        return None


def free_memory(run: Any) -> None:
    """Drop the failed step's gradients and hand the allocator's cached blocks back."""
    run.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    backend = getattr(torch, run.accelerator.device.type, None)
    if callable(getattr(backend, "empty_cache", None)):
        backend.empty_cache()


def oom_flags(model: Any, accelerator: Any, retries: int) -> OomFlags | None:
    """How the ranks of a DDP run learn of one rank's out-of-memory error
    (distributed/oom_flags.py); None with one process, without retries, under FSDP or
    DeepSpeed (not recoverable in place there), or without a rendezvous store.

    None on CPU ranks too, unless ``WORKBENCH_OOM_AGREEMENT=1``: torch's CPU allocator raises
    a RuntimeError, never ``OutOfMemoryError``, so there the per-step look-up would buy
    nothing (and it costs most where the ranks share busy cores: benchmarks/health_overhead.py
    --processes 2). The variable turns it on for code that raises ``OutOfMemoryError`` itself
    (and for the tests, which inject one)."""
    if accelerator.num_processes == 1 or retries == 0:
        return None
    if accelerator.device.type == "cpu" and os.environ.get("WORKBENCH_OOM_AGREEMENT") != "1":
        return None
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    store = rendezvous_store()
    return OomFlags(store, accelerator.process_index) if store is not None else None


def _memory_figures(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    gib = 2**30
    return (f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB, peak "
            f"{torch.cuda.max_memory_allocated(device) / gib:.2f} GiB of "
            f"{torch.cuda.get_device_properties(device).total_memory / gib:.2f} GiB")
