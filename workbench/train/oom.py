"""Out of memory, recovered in place: the step is redone with each micro-batch cut in half
and twice the accumulation, so the effective batch, the learning rate and the data order
stay what they were.

An out-of-memory error in forward or backward (``torch.OutOfMemoryError``) leaves the
step's gradients half made: they are dropped, the allocator's cache is emptied, and every
micro-batch of the step (and of every later step) is split into ``split`` equal parts along
its first dimension, trained one after another with ``split`` times the accumulation. The
change is recorded as a live edit (``micro_batch_split``, with the memory figures), as every
edit is (core/edits.py ``record_edit``: an ``edit`` event, and a Session's snapshot and
``edited`` event), which a checkpoint carries and a resume puts back; a resume's memory
forecast compares the pieces so cut. After ``oom_retries`` recoveries, or when a
micro-batch cannot be cut further, the run stops with a checkpoint and says why. An
evaluation batch that does not fit is cut in half too, for evaluation only (train/eval_oom.py).

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

from workbench.core.edits import record_edit
from workbench.core.event_file import EventFile
from workbench.core.trainer_utils import unwrap_model
from workbench.distributed.oom_flags import OomFlags, rendezvous_store
from workbench.train.memory import forecast_problem, host_rss, memory_report

__all__ = ["OomRecovery", "split_batch", "batch_rows", "is_out_of_memory", "free_memory", "oom_flags", "memory_figures",
           "figures_text"]

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

    def rows(self, per_device: int) -> int:
        """The rows of the largest micro-batch piece trained now, of micro-batches of
        ``per_device`` rows cut in ``split`` (what a step's activations grow with)."""
        return -(-per_device // self.split)

    def forecast(self, saved: dict[str, Any] | None, per_device: int) -> str | None:
        """Why a resumed run's micro-batches would not fit the device, forecast from its
        checkpoint's figures (train/memory.py), or None. After :meth:`restore`: a run that
        recovered from an out-of-memory error keeps its cut, so its pieces are compared with
        the rows the checkpoint measured, not the whole ``per_device_train_batch_size``."""
        problem = forecast_problem(saved, self.rows(per_device))
        if problem is not None and self.split > 1:
            problem += (f" (per_device_train_batch_size {per_device} cut in {self.split} since an out-of-memory "
                        "error)")
        return problem

    def recover(self, run: Any, micro: list[Any], where: str) -> str | None:
        """After an out-of-memory error (``where``: the phase, and the rank with several): free
        what the failed step held and cut the micro-batches in two (recorded as a live edit with
        the memory figures, core/edits.py record_edit). Returns None to redo the step, or why the
        run must stop instead (no retries left, or batches of one row). Every rank decides alike
        from the same counts."""
        figures = memory_figures(run.accelerator.device)  # before freeing: the memory as it ran out
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
        record = {"step": run.state.global_step, "time": time.time(), "micro_batch_split": self.split,
                  "reason": (f"out of memory in {where}: micro-batch {rows} -> {rows // self.split} rows, "
                             f"gradient accumulation {args.gradient_accumulation_steps * self.split // 2} -> "
                             f"{args.gradient_accumulation_steps * self.split} ({figures_text(figures)})"),
                  "memory": figures}
        record_edit(run, record)
        log.warning("step %d: %s; the step is redone", run.state.global_step + 1, record["reason"])
        return None


    def give_up(self, run: Any, why: str) -> None:
        """Memory ran out past what :meth:`recover` can do (``why``): say so, record what
        filled the memory (an ``oom`` event beside the reason), and stop the run with a
        checkpoint of the last boundary, which a resume with a smaller batch starts from."""
        step = run.state.global_step
        log.error("step %d: %s; stopping with a checkpoint of step %d", step + 1, why, step)
        if run.is_world_process_zero():
            report = memory_report(unwrap_model(run.model), run.optimizer).to_dict()
            EventFile(run.args.output_dir).write("oom", step, reason=why, **report)
        run.control.should_training_stop = run.control.should_save = True


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


def memory_figures(device: torch.device) -> dict[str, Any]:
    """The memory figures an out-of-memory edit carries, in bytes: the device's allocated,
    peak and total where its allocator counts them (CUDA; MPS: allocated), and this process's
    host resident set (all a CPU run has)."""
    figures: dict[str, Any] = {"device": device.type}
    if device.type == "cuda":
        figures.update(allocated=torch.cuda.memory_allocated(device), peak=torch.cuda.max_memory_allocated(device),
                       total=torch.cuda.get_device_properties(device).total_memory)
    elif device.type == "mps":
        figures["allocated"] = torch.mps.current_allocated_memory()
    figures["host_rss"] = host_rss()[0]
    return figures


def figures_text(figures: dict[str, Any]) -> str:
    """The figures of :func:`memory_figures` as the edit's reason says them, in GiB."""
    gib = 2**30
    if "total" in figures:
        return (f"allocated {figures['allocated'] / gib:.2f} GiB, peak {figures['peak'] / gib:.2f} GiB of "
                f"{figures['total'] / gib:.2f} GiB")
    if "allocated" in figures:
        return f"allocated {figures['allocated'] / gib:.2f} GiB"
    return f"host memory {figures['host_rss'] / gib:.2f} GiB"
