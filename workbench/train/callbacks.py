"""The built-in callbacks of the HF Trainer: ``DefaultFlowCallback`` (when to log, evaluate
and save), the progress printers and ``EarlyStoppingCallback``. The protocol they implement
(``TrainerCallback``, ``Event``, ``CallbackHandler``) is in workbench/core/callbacks.py.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from workbench.core.args import TrainingArguments
from workbench.core.callbacks import TrainerCallback
from workbench.core.records import is_timing_metric
from workbench.core.state import ExportableState, TrainerControl, TrainerState

# The warnings transformers' Trainer gives come out on its loggers' names, with its wording,
# so the handlers and verbosity settings of HF users and tools apply to them as well.
log = logging.getLogger("transformers.trainer_callback")

__all__ = ["DefaultFlowCallback", "ProgressCallback", "PrinterCallback", "EarlyStoppingCallback", "print_line",
           "logs_at_step", "stop_at_last_step"]


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def logs_at_step(args: TrainingArguments, state: TrainerState, step: int) -> bool:
    """Whether the end of optimizer step ``step`` is a logging point: the first step with
    ``logging_first_step``, every ``logging_steps`` with the "steps" strategy. One copy of
    the rule, because a kept fork's steps (train/forking.py), trained outside the loop, are
    logged afterwards exactly where the loop would have logged them."""
    return (step == 1 and bool(args.logging_first_step)) or (
        args.logging_strategy == "steps" and _due(step, state.logging_steps))


def stop_at_last_step(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> TrainerControl:
    """The flags of the run's last step (``global_step >= max_steps``), as HF sets them: stop;
    evaluate (eval_delay permitting) and save with the "steps" strategies, whether or not the
    step is due; it logs only if it is a logging step (the rest of the loss goes into
    train_loss); "epoch" saves in on_epoch_end, right after. One copy of the rule, because a
    kept fork that ends the run (train/forking.py) ends it as the loop's last step would."""
    control.should_training_stop = True
    if args.eval_strategy == "steps" and args.eval_delay <= state.global_step:
        control.should_evaluate = True
    if args.save_strategy == "steps":
        control.should_save = True
    return control


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate and save from the *_strategy / *_steps arguments."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if logs_at_step(args, state, step):
            control.should_log = True
        if args.eval_strategy == "steps" and _due(step, state.eval_steps) and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and _due(step, state.save_steps):
            control.should_save = True
        if step >= state.max_steps:
            stop_at_last_step(args, state, control)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= (state.epoch or 0):
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def print_line(text: str, stream: TextIO | None = None) -> TextIO | None:
    """Print a progress line to ``stream`` (stdout by default); returns the stream for the next
    one. When the terminal has hung up (EIO) or a pipe's reader has left (EPIPE), progress has
    no one to go to and must not end the run (the CLI stops a hung-up run with a checkpoint):
    the line is dropped and later ones go to /dev/null."""
    try:
        print(text, file=stream or sys.stdout, flush=True)
    except OSError as exc:
        if exc.errno not in (errno.EIO, errno.EPIPE):
            raise
        return open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as its printer
    return stream


class ProgressCallback(TrainerCallback):
    """Headless progress, the role HF's tqdm bars play: one line per log (step/total, epoch,
    loss, LR, samples/s, ETA), one per evaluation and one per sampled answer (SamplesCallback),
    on the main process only. It is the
    default unless ``disable_tqdm``; ``max_str_len`` is accepted for HF compatibility."""

    def __init__(self, max_str_len: int = 100, stream: TextIO | None = None) -> None:
        self.max_str_len = max_str_len
        self.stream = stream
        # Training time: a Session puts its pause clock here (session/progress.py), so elapsed,
        # samples/s and the ETA leave its pauses out and ``paused`` says how long they were.
        self.clock: Callable[[], float] = time.perf_counter
        self.paused: Callable[[], float] | None = None
        self._start: float | None = None
        self._start_step = 0
        self._first_began: float | None = None
        # Where the ETA's rate is measured from: the end of the first step, so the evaluation
        # before training and the first step's warm-up (one-offs) do not stretch it.
        self._rate_from: tuple[float, int] | None = None
        self._world = 1

    def _write(self, text: str) -> None:
        self.stream = print_line(text, self.stream)

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = self.clock()
        self._start_step = state.global_step
        self._world = int(os.environ.get("WORLD_SIZE", "1"))

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self._start_step:
            self._first_began = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self._start_step + 1:
            self._rate_from = (self.clock(), state.global_step)
        # The first step gets a line of its own, so a headless run shows it is training within
        # seconds, not only at the first logging step (logging_steps may be far). No rate or
        # ETA: one step, warm-up included, would extrapolate badly.
        if state.global_step == self._start_step + 1 and state.is_world_process_zero and not control.should_log:
            took = self.clock() - (self._first_began if self._first_began is not None else self.clock())
            nxt = f"; a progress line every {state.logging_steps} steps" if args.logging_strategy == "steps" else ""
            # Not "step N/M | ...": tools that read the progress lines (loss, lr) keep reading only those.
            self._write(f"training: step {state.global_step}/{state.max_steps} took {took:.2f} s{nxt}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if any(k.startswith(("eval_", "test_")) for k in logs):
            return  # evaluations print in on_evaluate
        if "train_runtime" in logs:
            runtime, rate = logs["train_runtime"], logs.get("train_samples_per_second", 0)
            paused = self.paused() if self.paused is not None else 0.0
            took = _clock(runtime)
            if paused >= 1 and self._start is not None:
                # train_runtime is wall time (HF's metric); the line counts training time, as the
                # progress lines did, with the pauses apart.
                runtime = max(self.clock() - self._start, 1e-9)
                rate = rate * logs["train_runtime"] / runtime
                took = f"{_clock(runtime)} (paused {_clock(paused)})"
            self._write(
                f"done: {state.global_step} steps in {took}"
                f" | train_loss {logs.get('train_loss', float('nan')):.4f}"
                f" | {rate:.1f} samples/s"
            )
            return
        self._write(" | ".join(self._progress_parts(args, state, logs)))

    def _progress_parts(self, args, state, logs: dict) -> list[str]:
        """step/total, epoch, the logged values, samples/s, elapsed (paused time apart), ETA."""
        now = self.clock()
        elapsed = now - (self._start if self._start is not None else now)
        done = state.global_step - self._start_step
        remaining = state.max_steps - state.global_step
        eta = self.eta(now, state.global_step, remaining)
        parts = [f"step {state.global_step}/{state.max_steps}", f"epoch {(state.epoch or 0):.2f}"]
        if "loss" in logs:
            parts.append(f"loss {logs['loss']:.4f}")
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.3g}")
        if "grad_norm" in logs:
            parts.append(f"grad_norm {logs['grad_norm']:.3g}")
        if done > 0 and state.train_batch_size and elapsed > 0:
            samples = done * state.train_batch_size * args.gradient_accumulation_steps * self._world
            parts.append(f"{samples / elapsed:.1f} samples/s")
        paused = self.paused() if self.paused is not None else 0.0
        parts.append(f"elapsed {_clock(elapsed)}" + (f" (paused {_clock(paused)})" if paused >= 1 else ""))
        parts.append(f"ETA {_clock(eta)}" if math.isfinite(eta) else "ETA ?")
        return parts

    def eta(self, now: float, step: int, remaining: int) -> float:
        """Seconds left at the rate since the first step ended (periodic evaluations and saves
        recur, so they belong in it; the evaluation before training and the warm-up do not);
        NaN before a second step has ended."""
        if self._rate_from is None or step <= self._rate_from[1]:
            return float("nan")
        began, first = self._rate_from
        return (now - began) / (step - first) * remaining

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or not metrics:
            return
        shown = [
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in metrics.items()
            if not is_timing_metric(k) and k != "epoch"  # the step is in the line already
        ]
        self._write(f"eval @ step {state.global_step}: " + " | ".join(shown))

    def on_sample(self, args, state, control, samples=None, **kwargs):
        # The first line of each answer, so a headless run's terminal shows what the model says.
        if not state.is_world_process_zero:
            return
        for sample in samples or ():
            answer = sample["answer"].strip().splitlines()[0] if sample["answer"].strip() else ""
            line = f"sample @ step {state.global_step}: {sample['prompt']!r} -> {answer!r}"
            self._write(line if len(line) <= 2 * self.max_str_len else line[:2 * self.max_str_len - 1] + "…")


class PrinterCallback(TrainerCallback):
    """HF's bare printer: each log dict as it is (floats as ``.4g``, without total_flos), on
    the local main process. The Trainer uses it instead of ProgressCallback with ``disable_tqdm``."""

    stream: TextIO | None = None  # stdout; /dev/null once the terminal is gone (print_line)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            # As HF's, on every process: total_flos leaves the logs dict itself, so with
            # disable_tqdm the metrics train() returns have none either (log_history keeps it).
            logs.pop("total_flos", None)
        if not state.is_local_process_zero or not logs:
            return
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items()}
        self.stream = print_line(str(shown), self.stream)


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stops training when ``metric_for_best_model`` has not improved by more than
    ``early_stopping_threshold`` for ``early_stopping_patience`` evaluations."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0) -> None:
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def check_metric_value(self, args, state, control, metric_value: float) -> None:
        """Count an evaluation without improvement (HF's rule): improving means beating
        ``state.best_metric`` by more than the threshold; the first value always improves."""
        best = state.best_metric
        improved = best is None or (
            (metric_value > best if args.greater_is_better else metric_value < best)
            and abs(metric_value - best) > self.early_stopping_threshold)
        if improved:
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs metric_for_best_model (for example 'loss')")
        if args.eval_strategy == "no":
            raise ValueError('EarlyStoppingCallback needs evaluations: set eval_strategy to "steps" or "epoch"')
        if not args.load_best_model_at_end:
            log.warning("Using EarlyStoppingCallback without load_best_model_at_end=True. "
                        "Once training is finished, the best model will not be loaded automatically.")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None:
            log.warning("early stopping required metric_for_best_model, but did not find %s so early stopping "
                        "is disabled", key)
            return
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {
                "early_stopping_patience_counter": self.early_stopping_patience_counter,
            },
        }
