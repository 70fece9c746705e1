"""Out of memory in evaluation: the evaluation batch is cut, the training batch never is.

An out-of-memory error in an evaluation batch's forward (``torch.OutOfMemoryError``) frees
what it can and runs that batch again cut into twice the parts, one after another, their
outputs joined back into the batch's (the row-weighted mean loss, the logits and labels
concatenated in order) before the batch is gathered. So the evaluation's gathers stay one a
batch with the same shapes whatever a rank's cut, and with several ranks the rank that ran
out redoes its batch alone: no other rank waits for it or redoes anything, and no row is
gathered twice or dropped. The cut (``trainer._eval_split``) holds for the rest of the
evaluation and for the run's later evaluations; it is no live edit (nothing of the training
changes, a checkpoint does not carry it), but a warning in the log and an ``eval_oom``
record in events.jsonl with the memory figures.

With several ranks the cut becomes every rank's: the rank that cut flags it in the
rendezvous store before it joins the batch's gathers, every rank reads the flags once after
the evaluation's last gather, and all of them take the largest cut for the evaluations after
(distributed/oom_flags.py ``EvalOomFlags``): one store look-up per evaluation, none per batch.
Two things make a rank's redo its own affair. DDP's wrapper broadcasts the buffers in the
first forward after training; a forward that failed after that broadcast leaves DDP's flag
asking for another, which this rank would then make alone: the flag is cleared as the other
ranks' finished forwards cleared theirs. And FSDP / DeepSpeed hold collectives inside the
forward, which a redo on one rank would unpair: there the error is re-raised with one line
that says what to do.
"""

from __future__ import annotations

import gc
import itertools
import logging
from typing import Any

import torch
from accelerate.utils import DistributedType

from workbench.core.event_file import EventFile
from workbench.core.run import Run
from workbench.distributed.oom_flags import EvalOomFlags, rendezvous_store
from workbench.train.oom import batch_rows, figures_text, memory_figures, split_batch

__all__ = ["EvalCuts"]

log = logging.getLogger("workbench")

# This process's evaluations, counted alike on every rank (each rank runs every evaluation:
# their gathers need it), so one evaluation's flags have one key and a later one never reads
# them; a count for the process, not the Trainer, so a second Trainer of one launch does not
# read the first one's.
_EVALUATIONS = itertools.count()

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


class EvalCuts:
    """One evaluation's out-of-memory policy on this rank: into how many parts each batch is
    cut (``split``, from the run's earlier evaluations), what this rank cut meanwhile, and the
    agreement of the ranks at its end."""

    def __init__(self, trainer: Run) -> None:
        self.trainer = trainer
        self.evaluation = next(_EVALUATIONS)
        self.split: int = getattr(trainer, "_eval_split", 1)
        self.cut: dict[str, Any] | None = None  # this rank's last cut in this evaluation
        acc = trainer.accelerator
        store = rendezvous_store() if acc.num_processes > 1 else None
        self.flags = EvalOomFlags(store, acc.process_index, acc.num_processes) if store is not None else None

    def predict(self, model: Any, inputs: Any, loss_only: bool, ignore_keys: Any) -> tuple:
        """``trainer.prediction_step`` of one batch: ``(loss, logits, labels)`` of the whole
        batch, computed in ``split`` parts (pieces of one row at least) and joined, and cut
        further while it runs out of memory."""
        trainer = self.trainer
        while True:
            parts = min(self.split, max(batch_rows(inputs), 1))
            try:
                if parts == 1:
                    return trainer.prediction_step(model, inputs, loss_only, ignore_keys=ignore_keys)
                pieces = split_batch(inputs, parts)
                return _joined([trainer.prediction_step(model, piece, loss_only, ignore_keys=ignore_keys)
                                for piece in pieces], [batch_rows(piece) for piece in pieces])
            except torch.OutOfMemoryError as error:
                # Its traceback holds the failed forward's frames and their tensors: dropped,
                # and the cut (which frees the memory) made once this handler has let go of them.
                failed = error.with_traceback(None)
            self._cut(model, batch_rows(inputs), failed)

    def _cut(self, model: Any, rows: int, error: torch.OutOfMemoryError) -> None:
        """After an out-of-memory error in a batch of ``rows``: cut into twice the parts (and
        say so), or re-raise with what to do when that cannot be done in place."""
        acc = self.trainer.accelerator
        several = acc.num_processes > 1
        where = f" on rank {acc.process_index}" if several else ""
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if several and not ddp and acc.distributed_type in _SHARDED:
            raise torch.OutOfMemoryError(
                f"evaluation ran out of memory{where}, not recoverable in place (FSDP and DeepSpeed hold "
                "collectives in the forward); lower per_device_eval_batch_size") from error
        before = -(-rows // self.split)  # the rows of the largest piece that failed
        if before < 2:
            raise torch.OutOfMemoryError(
                f"evaluation ran out of memory{where} with batches of {before} row(s): nothing left to cut; "
                "lower the sequence length or use a device with more memory") from error
        figures = memory_figures(acc.device)  # before freeing: the memory as it ran out
        _free(acc.device)
        if ddp:
            # The failed forward may have broadcast the buffers (DDP's first forward after
            # training does) without reaching the point where DDP clears its flag: the other
            # ranks' forwards cleared theirs, so this rank's redo must not broadcast alone.
            model.require_forward_param_sync = False
        self.split *= 2
        self.trainer._eval_split = max(getattr(self.trainer, "_eval_split", 1), self.split)
        after = -(-rows // self.split)
        if self.cut is not None:  # cut again in this evaluation: the record spans both
            before = self.cut["rows"][0]
        self.cut = {"split": self.split, "rows": [before, after], "memory": figures,
                    "reason": (f"out of memory in evaluation{where}: eval batch {before} -> {after} rows "
                               f"({figures_text(figures)}); the training batch is unchanged")}
        log.warning("%s; the batch is redone in %d parts", self.cut["reason"], self.split)
        if self.flags is not None:
            # Written before this rank joins the batch's gathers: every rank reads it after the
            # evaluation's last gather, which this rank cannot have left without them.
            self.flags.raise_flag(self.evaluation, self.cut)

    def settle(self) -> None:
        """After the evaluation's last gather: the ranks' cuts of this evaluation, read by
        every rank alike; the largest becomes every rank's cut for the run's later
        evaluations, and rank 0 records them (an ``eval_oom`` record in events.jsonl)."""
        trainer = self.trainer
        if self.flags is not None:
            cuts = self.flags.read(self.evaluation)
        else:
            cuts = [{**self.cut, "rank": trainer.accelerator.process_index}] if self.cut is not None else []
        if not cuts:
            return
        split = max(cut["split"] for cut in cuts)
        trainer._eval_split = max(getattr(trainer, "_eval_split", 1), split)
        if not trainer.is_world_process_zero():
            return
        reason = "; ".join(cut["reason"] for cut in cuts)
        if any(cut["rank"] != trainer.accelerator.process_index for cut in cuts):
            log.warning("%s: every rank cuts its evaluation batches into %d parts from now on", reason, split)
        record = {"split": split, "reason": reason, "cuts": cuts}
        EventFile(trainer.args.output_dir).write("eval_oom", trainer.state.global_step, **record)
        for listener in list(getattr(trainer, "health_listeners", ())):  # a Session: an event, live
            listener("eval_oom", record)


def _joined(parts: list[tuple], rows: list[int]) -> tuple:
    """(loss, logits, labels) of a batch from its pieces': the row-weighted mean loss, the
    rest concatenated along the batch."""
    losses = [p[0] for p in parts]
    loss = None
    if all(x is not None for x in losses):
        loss = sum(x * r for x, r in zip(losses, rows)) / sum(rows)

    def cat(values: list[Any]) -> Any:
        if any(v is None for v in values):
            return None
        if isinstance(values[0], (tuple, list)):
            return type(values[0])(cat(list(group)) for group in zip(*values))
        return torch.cat(values, dim=0)

    return loss, cat([p[1] for p in parts]), cat([p[2] for p in parts])


def _free(device: torch.device) -> None:
    """Hand back what the failed forward held: its tensors (a collection frees the cycles the
    traceback kept) and the allocator's cached blocks. The training's gradients stay."""
    gc.collect()
    backend = getattr(torch, device.type, None)
    if callable(getattr(backend, "empty_cache", None)):
        backend.empty_cache()
