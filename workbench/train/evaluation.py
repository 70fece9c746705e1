"""Evaluation and prediction loops.

Per batch: loss, logits and labels are gathered across processes (duplicates from an
uneven last batch dropped by ``gather_for_metrics``), optionally reduced on the device by
``preprocess_logits_for_metrics``, and held on the device until ``eval_accumulation_steps``
batches have passed, when they move to the CPU. Tensors of different sequence lengths are
padded with -100 before concatenation. A batch that runs out of memory is computed again in
parts, for evaluation only (train/eval_oom.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from workbench.checkpoint.state_dicts import nested_nbytes
from workbench.core.trainer_utils import EvalLoopOutput, EvalPrediction, PredictionOutput, has_length, speed_metrics, unwrap_model
from workbench.core.run import Run
from workbench.train.eval_oom import EvalCuts


__all__ = ["evaluate", "predict", "evaluation_loop", "concat_batches", "pad_and_concat", "nested_to_cpu"]


PAD_INDEX = -100


def _apply(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_apply(fn, v) for v in value)
    if isinstance(value, Mapping):  # a dict, a ModelOutput, or an HF collator's BatchEncoding
        return {k: _apply(fn, v) for k, v in value.items()}
    return fn(value) if isinstance(value, torch.Tensor) else value


def nested_to_cpu(value: Any) -> Any:
    """Move every tensor in a nested structure to the CPU."""
    return _apply(lambda t: t.cpu(), value)


def _concat_tensors(parts: list[torch.Tensor], pad: int) -> torch.Tensor:
    parts = [t.reshape(1) if t.dim() == 0 else t for t in parts]
    first = parts[0]
    if first.dim() == 1 or all(t.shape[1:] == first.shape[1:] for t in parts):
        return torch.cat(parts, dim=0)
    # Different sequence lengths across batches: pad every dim after the first.
    tail = [max(t.shape[d] for t in parts) for d in range(1, first.dim())]
    out = first.new_full([sum(t.shape[0] for t in parts), *tail], pad)
    row = 0
    for t in parts:
        out[(slice(row, row + t.shape[0]), *(slice(0, n) for n in t.shape[1:]))] = t
        row += t.shape[0]
    return out


def concat_batches(batches: list[Any], pad: int = PAD_INDEX) -> Any:
    """Concatenate (nested) batches along dim 0 in one pass, padding other dims with ``pad``."""
    if not batches:
        return None
    first = batches[0]
    if isinstance(first, (list, tuple)):
        return type(first)(concat_batches([b[i] for b in batches], pad) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: concat_batches([b[k] for b in batches], pad) for k in first}
    return _concat_tensors(list(batches), pad)


def pad_and_concat(a: Any, b: Any, pad: int = PAD_INDEX) -> Any:
    """Concatenate two (nested) batches along dim 0, padding other dims with ``pad``."""
    if a is None:
        return b
    return concat_batches([a, b], pad)


def _to_numpy(value: Any) -> Any:
    if value is None:
        return None
    return _apply(lambda t: t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(), nested_to_cpu(value))


class _Accumulator:
    """Batches of one output kind (logits, labels, ...): held on the device until
    ``offload()`` moves them to the host. Concatenation happens once, at the end, so
    the cost stays linear in the number of batches."""

    def __init__(self) -> None:
        self.on_device: list[Any] = []
        self.on_host: list[Any] = []
        self.device_bytes = 0
        self.peak_device_bytes = 0

    def add(self, value: Any) -> None:
        if value is None:
            return
        self.on_device.append(value)
        self.device_bytes += nested_nbytes(value)
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def offload(self) -> None:
        self.on_host.extend(nested_to_cpu(v) for v in self.on_device)
        self.on_device, self.device_bytes = [], 0

    def result(self, concat: bool) -> Any:
        self.offload()
        if not self.on_host:
            return None
        if concat:
            return _to_numpy(concat_batches(self.on_host))
        return [_to_numpy(v) for v in self.on_host]


def _real_rows(acc, batch_size: int) -> int:
    """How many rows of this rank's current batch are real samples, not padding repeats.

    With several processes the last global batch is split in rank order and each rank's
    share topped up to a full batch; Accelerate knows how many samples it really held.
    """
    state = acc.gradient_state
    if (acc.num_processes == 1 or not state.end_of_dataloader or state.remainder <= 0
            or acc.dataloader_config.split_batches):
        return batch_size
    return min(max(state.remainder - acc.process_index * batch_size, 0), batch_size)


def _head(inputs: Any, n: int, batch_size: int) -> Any:
    """The first ``n`` rows of every batch-sized tensor in ``inputs``."""
    if isinstance(inputs, Mapping):
        return {k: _head(v, n, batch_size) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(_head(v, n, batch_size) for v in inputs)
    if isinstance(inputs, torch.Tensor) and inputs.dim() > 0 and inputs.shape[0] == batch_size:
        return inputs[:n]
    return inputs


def evaluation_loop(trainer: Run, dataloader, description: str, prediction_loss_only: bool | None = None,
                    ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
    """Run the model over ``dataloader`` and compute metrics (HF's evaluation_loop).

    The body of ``Trainer.evaluation_loop``; evaluate() and predict() reach it through that
    method, so a subclass overriding it is honoured. Batches go through
    ``trainer.prediction_step``.
    """
    args, acc = trainer.args, trainer.accelerator
    handler = trainer.callback_handler
    loss_only = args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
    model = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    handler.eval_dataloader = dataloader
    model.eval()
    concat = args.eval_do_concat_batches
    # Full-precision eval modes run the forward in half precision without touching the
    # training weights (the model may be mid-run).
    half = torch.float16 if args.fp16_full_eval else torch.bfloat16 if args.bf16_full_eval else None
    precision = torch.autocast(acc.device.type, dtype=half) if half is not None else contextlib.nullcontext()
    parts = {name: _Accumulator() for name in ("losses", "preds", "labels", "inputs")}
    stop_was_requested = trainer.control.should_training_stop
    interrupted = False
    include_inputs = "inputs" in args.include_for_metrics
    include_loss = "loss" in args.include_for_metrics
    batch_metrics = args.batch_eval_metrics and trainer.compute_metrics is not None and not loss_only
    # As HF: with batched metrics an evaluation keeps no predictions, but predict() still
    # returns them (and the labels and inputs).
    keep = not batch_metrics or description == "Prediction"
    # eval_use_gather_object: predictions of varying shapes are gathered as Python objects.
    gather = functools.partial(acc.gather_for_metrics, use_gather_object=args.eval_use_gather_object)
    losses_for_mean: list[torch.Tensor] = []
    num_samples = 0
    metrics: dict[str, Any] | None = None
    n_batches = len(dataloader) if has_length(dataloader) else None
    ledger = getattr(trainer, "ledger", None)
    # A batch that runs out of memory is cut for evaluation only, and on this rank alone:
    # its pieces are joined before the gathers below, which so stay one a batch (eval_oom.py).
    cuts = EvalCuts(trainer)
    for step, inputs in enumerate(dataloader):
        batch_size = _batch_size(inputs)
        num_samples_batch = batch_size
        with precision:
            loss, logits, labels = cuts.predict(model, inputs, loss_only, ignore_keys)
        main_input = inputs.get(getattr(unwrap_model(trainer.model), "main_input_name", "input_ids")) \
            if include_inputs and isinstance(inputs, Mapping) else None
        if loss is not None:
            real = _real_rows(acc, batch_size)
            if 0 < real < batch_size:
                # This rank's last batch was topped up with repeated samples so every rank
                # has one; gather_for_metrics drops their rows, but the batch's mean loss
                # still counted them. Recompute it over the real rows (one batch per eval).
                with precision:
                    loss = cuts.predict(model, _head(inputs, real, batch_size), True, ignore_keys)[0]
            batch_losses = acc.gather_for_metrics(loss.repeat(batch_size))
            losses_for_mean.append(batch_losses)
            num_samples_batch = batch_losses.numel()
            if include_loss or batch_metrics:
                parts["losses"].add(batch_losses)
        if main_input is not None:
            main_input = gather(acc.pad_across_processes(main_input, dim=1, pad_index=PAD_INDEX))
        if labels is not None:
            labels = gather(acc.pad_across_processes(labels, dim=1, pad_index=PAD_INDEX))
        if logits is not None:
            logits = acc.pad_across_processes(logits, dim=1, pad_index=PAD_INDEX)
            if trainer.preprocess_logits_for_metrics is not None:
                logits = trainer.preprocess_logits_for_metrics(logits, labels)
            logits = gather(logits)
        num_samples += num_samples_batch
        trainer.control = handler.on_prediction_step(args, trainer.state, trainer.control)
        trainer.gates.evaluation_point(trainer)  # a stop asked for meanwhile cuts the evaluation short
        if ledger is not None:
            ledger.mark()  # a batch done: a long evaluation that makes progress is no hang (health.py)
        if batch_metrics:
            # Without a length (iterable eval set), Accelerate's loader looks one batch
            # ahead and flags the last one.
            last = (step == n_batches - 1 if n_batches is not None
                    else bool(getattr(dataloader, "end_of_dataloader", False)))
            pred = EvalPrediction(logits, labels, inputs=main_input if include_inputs else None,
                                  losses=batch_losses if include_loss and loss is not None else None)
            metrics = trainer.compute_metrics(pred, compute_result=last)
            parts["losses"] = _Accumulator()
        if keep:
            parts["inputs"].add(main_input)
            parts["preds"].add(None if loss_only else logits)
            parts["labels"].add(None if loss_only else labels)
            if args.eval_accumulation_steps is not None and (step + 1) % args.eval_accumulation_steps == 0:
                for part in parts.values():
                    part.offload()
        if trainer.control.should_training_stop and not stop_was_requested:
            # A stop asked for during this evaluation (SIGTERM, the UI): honour it now
            # rather than after the remaining batches.
            interrupted = True
            break
    cuts.settle()  # after the last gather: every rank's cuts, agreed for the evaluations after
    # Bytes of predictions/labels/inputs/losses held on the device at the worst moment:
    # what eval_accumulation_steps and preprocess_logits_for_metrics exist to bound.
    trainer.eval_peak_device_bytes = sum(part.peak_device_bytes for part in parts.values())
    all_losses = torch.cat(losses_for_mean).float() if losses_for_mean else None
    preds = parts["preds"].result(concat)
    label_ids = parts["labels"].result(concat)
    if not batch_metrics and not interrupted:
        if trainer.compute_metrics is not None and preds is not None and label_ids is not None:
            pred = EvalPrediction(preds, label_ids,
                                  inputs=parts["inputs"].result(concat) if include_inputs else None,
                                  losses=parts["losses"].result(concat) if include_loss else None)
            metrics = trainer.compute_metrics(pred)
    metrics = dict(metrics or {})
    metrics = {k: v.item() if isinstance(v, (torch.Tensor, np.generic)) else v for k, v in metrics.items()}
    if all_losses is not None and all_losses.numel():
        # The reference: with logging_nan_inf_filter, NaN/Inf batches (e.g. ones without
        # any target) are left out of the eval loss. If every batch is non-finite the loss
        # is reported as NaN, never dropped, so best-metric tracking sees the divergence.
        # The mean is NumPy's over float32, as HF's (torch sums in another order: the last bits differ).
        values = all_losses.cpu().numpy()
        finite = values[np.isfinite(values)] if args.logging_nan_inf_filter else values
        metrics[f"{metric_key_prefix}_loss"] = (finite if finite.size else values).mean().item()
    for key in list(metrics):
        if not key.startswith(f"{metric_key_prefix}_"):
            metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
    if interrupted:
        metrics[f"{metric_key_prefix}_interrupted"] = True
    return EvalLoopOutput(predictions=preds, label_ids=label_ids, metrics=metrics, num_samples=num_samples)


def _batch_size(inputs: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor. Any ``Mapping`` is a batch of
    named inputs (HF's collators return ``BatchEncoding``, a ``UserDict``), as in HF."""
    if isinstance(inputs, Mapping):
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return value.shape[0]
    if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], torch.Tensor):
        return inputs[0].shape[0]
    return 1


def _run_one(trainer: Run, dataset: Any, ignore_keys: list[str] | None, prefix: str) -> dict[str, float]:
    """One evaluation, through the Trainer's override points: ``get_eval_dataloader`` builds
    the loader (``dataset`` is a set, a name of one of the Trainer's sets, or None) and
    ``evaluation_loop`` runs it."""
    trainer._memory_stage("eval", start=True)
    start = time.perf_counter()
    loader = trainer.get_eval_dataloader(dataset)
    output = trainer.evaluation_loop(loader, "Evaluation", ignore_keys=ignore_keys, metric_key_prefix=prefix)
    metrics = output.metrics
    n_batches = len(loader) if has_length(loader) else None
    metrics.update(speed_metrics(prefix, start, num_samples=output.num_samples, num_steps=n_batches))
    metrics.update(trainer._memory_stage("eval", start=False))
    return metrics


def evaluate(trainer: Run, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
    """Evaluate one set (or each of a dict of named sets) and report the metrics.

    As in HF, the Trainer's own named sets reach ``get_eval_dataloader`` by name and a set
    passed here as itself, so an override sees what it would see in transformers.
    """
    ledger = getattr(trainer, "ledger", None)
    with ledger.during("evaluation") if ledger is not None else contextlib.nullcontext():
        return _evaluate_sets(trainer, eval_dataset, ignore_keys, metric_key_prefix)


def _evaluate_sets(trainer: Run, eval_dataset, ignore_keys, metric_key_prefix: str) -> dict[str, float]:
    override = eval_dataset is not None
    target = eval_dataset if override else trainer.eval_dataset
    if isinstance(target, dict):
        metrics: dict[str, float] = {}
        for name, dataset in target.items():
            metrics.update(_run_one(trainer, dataset if override else name, ignore_keys, f"{metric_key_prefix}_{name}"))
    else:
        prefix = f"{metric_key_prefix}_{eval_dataset}" if isinstance(eval_dataset, str) else metric_key_prefix
        metrics = _run_one(trainer, eval_dataset, ignore_keys, prefix)
    trainer.log(metrics)  # as HF: the returned metrics carry the epoch too
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    trainer.gates.evaluation_point(trainer)
    return metrics


def predict(trainer: Run, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
    """Predictions, label ids and metrics for ``test_dataset`` (metrics prefixed ``test_``), through
    the Trainer's ``get_test_dataloader`` and ``evaluation_loop``."""
    start = time.perf_counter()
    loader = trainer.get_test_dataloader(test_dataset)
    output = trainer.evaluation_loop(loader, "Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
    output.metrics.update(speed_metrics(metric_key_prefix, start, num_samples=output.num_samples,
                                        num_steps=len(loader) if has_length(loader) else None))
    trainer.control = trainer.callback_handler.on_predict(trainer.args, trainer.state, trainer.control, output.metrics)
    return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)
