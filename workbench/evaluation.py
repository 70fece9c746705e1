"""Evaluation and prediction loops.

Per batch: loss, logits and labels are gathered across processes (duplicates from an
uneven last batch dropped by ``gather_for_metrics``), optionally reduced on the device by
``preprocess_logits_for_metrics``, and held on the device until ``eval_accumulation_steps``
batches have passed, when they move to the CPU. Tensors of different sequence lengths are
padded with -100 before concatenation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .trainer_utils import EvalLoopOutput, EvalPrediction, PredictionOutput, has_length, speed_metrics

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["evaluate", "predict", "evaluation_loop", "pad_and_concat", "nested_to_cpu"]

PAD_INDEX = -100


def _apply(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_apply(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _apply(fn, v) for k, v in value.items()}
    return fn(value) if isinstance(value, torch.Tensor) else value


def nested_to_cpu(value: Any) -> Any:
    """Move every tensor in a nested structure to the CPU."""
    return _apply(lambda t: t.cpu(), value)


def _pad_concat_pair(a: torch.Tensor, b: torch.Tensor, pad: int) -> torch.Tensor:
    if a.dim() == 0:
        a = a.reshape(1)
    if b.dim() == 0:
        b = b.reshape(1)
    if a.dim() == 1 or a.shape[1:] == b.shape[1:]:
        return torch.cat([a, b.to(a.device)], dim=0)
    # Different sequence lengths: pad dim 1 (and beyond) to the larger size.
    shape = [a.shape[0] + b.shape[0]] + [max(x, y) for x, y in zip(a.shape[1:], b.shape[1:])]
    out = a.new_full(shape, pad)
    out[: a.shape[0], : a.shape[1]] = a
    out[a.shape[0]:, : b.shape[1]] = b.to(a.device)
    return out


def pad_and_concat(a: Any, b: Any, pad: int = PAD_INDEX) -> Any:
    """Concatenate two (nested) batches along dim 0, padding other dims with ``pad``."""
    if a is None:
        return b
    if isinstance(a, (list, tuple)):
        return type(a)(pad_and_concat(x, y, pad) for x, y in zip(a, b))
    if isinstance(a, dict):
        return {k: pad_and_concat(a[k], b[k], pad) for k in a}
    return _pad_concat_pair(a, b, pad)


def _to_numpy(value: Any) -> Any:
    if value is None:
        return None
    return _apply(lambda t: t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(), nested_to_cpu(value))


class _Accumulator:
    """Holds one kind of output (logits, labels, ...) on the device, then on the CPU."""

    def __init__(self, concat: bool) -> None:
        self.concat = concat
        self.device_part: Any = None
        self.host_part: Any = None if concat else []
        self.nbytes_peak = 0

    def add(self, value: Any) -> None:
        if value is None:
            return
        if self.concat:
            self.device_part = pad_and_concat(self.device_part, value)
        else:
            self.host_part.append(value)
        self.nbytes_peak = max(self.nbytes_peak, _nbytes(self.device_part) + _nbytes(self.host_part))

    def offload(self) -> None:
        if self.concat and self.device_part is not None:
            self.host_part = pad_and_concat(self.host_part, nested_to_cpu(self.device_part))
            self.device_part = None

    def result(self) -> Any:
        self.offload()
        if self.concat:
            return _to_numpy(self.host_part)
        return [_to_numpy(v) for v in self.host_part] or None


def _nbytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def evaluation_loop(trainer: "Trainer", dataloader, description: str, prediction_loss_only: bool | None = None,
                    ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
    """Run the model over ``dataloader`` and compute metrics (HF's evaluation_loop)."""
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
    parts = {name: _Accumulator(concat) for name in ("losses", "preds", "labels", "inputs")}
    include_inputs = "inputs" in args.include_for_metrics
    include_loss = "loss" in args.include_for_metrics
    batch_metrics = args.batch_eval_metrics and trainer.compute_metrics is not None and not loss_only
    losses_for_mean: list[torch.Tensor] = []
    num_samples = 0
    metrics: dict[str, Any] | None = None
    n_batches = len(dataloader) if has_length(dataloader) else None
    for step, inputs in enumerate(dataloader):
        batch_size = _batch_size(inputs)
        num_samples_batch = batch_size
        with precision:
            loss, logits, labels = trainer.prediction_step(model, inputs, loss_only, ignore_keys=ignore_keys)
        main_input = inputs.get(getattr(trainer.accelerator.unwrap_model(trainer.model), "main_input_name", "input_ids")) \
            if include_inputs and isinstance(inputs, dict) else None
        if loss is not None:
            batch_losses = acc.gather_for_metrics(loss.repeat(batch_size))
            losses_for_mean.append(batch_losses)
            num_samples_batch = batch_losses.numel()
            if include_loss or batch_metrics:
                parts["losses"].add(batch_losses)
        if main_input is not None:
            main_input = acc.gather_for_metrics(acc.pad_across_processes(main_input, dim=1, pad_index=PAD_INDEX))
            parts["inputs"].add(main_input)
        if labels is not None:
            labels = acc.gather_for_metrics(acc.pad_across_processes(labels, dim=1, pad_index=PAD_INDEX))
        if logits is not None:
            logits = acc.pad_across_processes(logits, dim=1, pad_index=PAD_INDEX)
            if trainer.preprocess_logits_for_metrics is not None:
                logits = trainer.preprocess_logits_for_metrics(logits, labels)
            logits = acc.gather_for_metrics(logits)
        num_samples += num_samples_batch
        trainer.control = handler.on_prediction_step(args, trainer.state, trainer.control)
        if batch_metrics:
            last = n_batches is not None and step == n_batches - 1
            pred = EvalPrediction(logits, labels, inputs=main_input if include_inputs else None,
                                  losses=batch_losses if include_loss and loss is not None else None)
            metrics = trainer.compute_metrics(pred, compute_result=last)
            parts["losses"] = _Accumulator(concat)
        else:
            parts["preds"].add(None if loss_only else logits)
            parts["labels"].add(None if loss_only else labels)
            if args.eval_accumulation_steps is not None and (step + 1) % args.eval_accumulation_steps == 0:
                for part in parts.values():
                    part.offload()
    trainer._eval_peak_bytes = sum(part.nbytes_peak for part in parts.values())
    all_losses = torch.cat(losses_for_mean).float() if losses_for_mean else None
    preds = parts["preds"].result()
    label_ids = parts["labels"].result()
    if not batch_metrics:
        if trainer.compute_metrics is not None and preds is not None and label_ids is not None:
            pred = EvalPrediction(preds, label_ids,
                                  inputs=parts["inputs"].result() if include_inputs else None,
                                  losses=parts["losses"].result() if include_loss else None)
            metrics = trainer.compute_metrics(pred)
    metrics = dict(metrics or {})
    metrics = {k: v.item() if isinstance(v, (torch.Tensor, np.generic)) else v for k, v in metrics.items()}
    if all_losses is not None and all_losses.numel():
        finite = all_losses[torch.isfinite(all_losses)] if args.logging_nan_inf_filter else all_losses
        if finite.numel():
            metrics[f"{metric_key_prefix}_loss"] = finite.mean().item()
    for key in list(metrics):
        if not key.startswith(f"{metric_key_prefix}_"):
            metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
    return EvalLoopOutput(predictions=preds, label_ids=label_ids, metrics=metrics, num_samples=num_samples)


def _batch_size(inputs: Any) -> int:
    if isinstance(inputs, dict):
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return value.shape[0]
    if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], torch.Tensor):
        return inputs[0].shape[0]
    return 1


def _run_one(trainer: "Trainer", dataset, ignore_keys, prefix: str) -> dict[str, float]:
    start = time.perf_counter()
    loader = trainer._eval_loader(dataset, "evaluation")
    output = evaluation_loop(trainer, loader, "Evaluation", ignore_keys=ignore_keys, metric_key_prefix=prefix)
    metrics = output.metrics
    n_batches = len(loader) if has_length(loader) else None
    metrics.update(speed_metrics(prefix, start, num_samples=output.num_samples, num_steps=n_batches))
    return metrics


def evaluate(trainer: "Trainer", eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
    """Evaluate one set (or each of a dict of named sets) and report the metrics."""
    target = eval_dataset if eval_dataset is not None else trainer.eval_dataset
    if isinstance(target, dict):
        metrics: dict[str, float] = {}
        for name, dataset in target.items():
            metrics.update(_run_one(trainer, dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
    else:
        dataset = trainer._resolve_eval_dataset(eval_dataset)
        prefix = f"{metric_key_prefix}_{eval_dataset}" if isinstance(eval_dataset, str) else metric_key_prefix
        metrics = _run_one(trainer, dataset, ignore_keys, prefix)
    trainer.log(dict(metrics))
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    return metrics


def predict(trainer: "Trainer", test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
    """Predictions, label ids and metrics for ``test_dataset`` (metrics prefixed ``test_``)."""
    start = time.perf_counter()
    loader = trainer.get_test_dataloader(test_dataset)
    output = evaluation_loop(trainer, loader, "Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
    output.metrics.update(speed_metrics(metric_key_prefix, start, num_samples=output.num_samples,
                                        num_steps=len(loader) if has_length(loader) else None))
    trainer.control = trainer.callback_handler.on_predict(trainer.args, trainer.state, trainer.control, output.metrics)
    return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)
