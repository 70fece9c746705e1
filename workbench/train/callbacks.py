"""Callbacks: the hooks of the HF Trainer, its state and control objects, and built-ins.

``Event`` values are the hook method names, so dispatch is ``getattr(callback, event)``
and a callback written for transformers' Trainer works here by duck typing. The handler
precomputes, per event, only the callbacks that implement it: a hook nobody overrides
costs nothing on the hot path.
"""

from __future__ import annotations

import abc
import enum
import errno
import logging
import math
import os
import sys
import time
from typing import Any, TextIO

from workbench.records import is_timing_metric
from workbench.train.run_state import (
    WORKBENCH_STATE_FIELDS,
    WORKBENCH_STATE_NAME,
    ExportableState,
    TrainerControl,
    TrainerState,
    WorkbenchState,
    is_hf_class,
)

# The warnings transformers' Trainer gives come out on its loggers' names, with its wording,
# so the handlers and verbosity settings of HF users and tools apply to them as well.
log = logging.getLogger("transformers.trainer_callback")
trainer_log = logging.getLogger("transformers.trainer")

__all__ = [
    "Event",
    "TrainerState",
    "TrainerControl",
    "WorkbenchState",
    "WORKBENCH_STATE_FIELDS",
    "WORKBENCH_STATE_NAME",
    "TrainerCallback",
    "CallbackHandler",
    "DefaultFlowCallback",
    "ProgressCallback",
    "PrinterCallback",
    "EarlyStoppingCallback",
    "ExportableState",
]


class Event(enum.StrEnum):
    """Lifecycle events; each value is the name of the hook method it calls."""

    ON_INIT_END = "on_init_end"
    ON_TRAIN_BEGIN = "on_train_begin"
    ON_TRAIN_END = "on_train_end"
    ON_EPOCH_BEGIN = "on_epoch_begin"
    ON_EPOCH_END = "on_epoch_end"
    ON_STEP_BEGIN = "on_step_begin"
    ON_PRE_OPTIMIZER_STEP = "on_pre_optimizer_step"
    ON_OPTIMIZER_STEP = "on_optimizer_step"
    ON_SUBSTEP_END = "on_substep_end"
    ON_STEP_END = "on_step_end"
    ON_EVALUATE = "on_evaluate"
    ON_PREDICT = "on_predict"
    ON_SAVE = "on_save"
    ON_LOG = "on_log"
    ON_PREDICTION_STEP = "on_prediction_step"
    ON_PUSH_BEGIN = "on_push_begin"
    # workbench additions: a run that fails, so sinks can record the error.
    ON_ERROR = "on_error"


class TrainerCallback(abc.ABC):
    """Base class with every hook of the HF Trainer; override the ones you need.

    Hooks receive ``(args, state, control, **kwargs)`` with kwargs such as model,
    optimizer, lr_scheduler, train_dataloader, eval_dataloader, metrics, logs. Returning a
    ``TrainerControl`` replaces the control object, as in transformers.

    A ``transformers.TrainerCallback`` is one as well: ``isinstance(cb, TrainerCallback)``
    is True for it (workbench does not import transformers, so the converse is not).
    """

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        if cls is TrainerCallback and is_hf_class(other, "TrainerCallback"):
            return True
        return NotImplemented

    def on_init_end(self, args, state, control, **kwargs): ...
    def on_train_begin(self, args, state, control, **kwargs): ...
    def on_train_end(self, args, state, control, **kwargs): ...
    def on_epoch_begin(self, args, state, control, **kwargs): ...
    def on_epoch_end(self, args, state, control, **kwargs): ...
    def on_step_begin(self, args, state, control, **kwargs): ...
    def on_pre_optimizer_step(self, args, state, control, **kwargs): ...
    def on_optimizer_step(self, args, state, control, **kwargs): ...
    def on_substep_end(self, args, state, control, **kwargs): ...
    def on_step_end(self, args, state, control, **kwargs): ...
    def on_evaluate(self, args, state, control, **kwargs): ...
    def on_predict(self, args, state, control, metrics, **kwargs): ...
    def on_save(self, args, state, control, **kwargs): ...
    def on_log(self, args, state, control, logs=None, **kwargs): ...
    def on_prediction_step(self, args, state, control, **kwargs): ...
    def on_push_begin(self, args, state, control, **kwargs): ...
    def on_error(self, args, state, control, error=None, **kwargs): ...


# Classes both families have, with the same name and meaning: either one stands for the other
# when a callback is removed, popped, or added a second time.
SHARED_CALLBACKS = frozenset({"DefaultFlowCallback", "PrinterCallback", "ProgressCallback", "EarlyStoppingCallback"})


def same_kind(a: type, b: type) -> bool:
    """Whether callback classes ``a`` and ``b`` are one, or the two families' versions of one
    of the built-ins (workbench's ``DefaultFlowCallback`` and transformers')."""
    if a is b:
        return True
    if a.__name__ != b.__name__ or a.__name__ not in SHARED_CALLBACKS:
        return False
    families = {__name__, "transformers.trainer_callback"}
    return a.__module__ in families and b.__module__ in families


def _implements(callback: Any, hook: str) -> bool:
    """Whether calling ``hook`` on ``callback`` can do anything.

    Inherited no-op hooks (ours, or transformers' base class of the same name) are skipped.
    """
    method = getattr(callback, hook, None)
    if method is None:
        return False
    func = getattr(method, "__func__", method)
    return getattr(func, "__qualname__", "") != f"TrainerCallback.{hook}"


class CallbackHandler(TrainerCallback):
    """Holds the callbacks and calls them in order, as transformers' handler does."""

    def __init__(self, callbacks, model, processing_class, optimizer, lr_scheduler) -> None:
        self.callbacks: list[Any] = []
        for cb in callbacks or []:
            self.add_callback(cb)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None

    # -- the list ---------------------------------------------------------------------

    def add_callback(self, callback: Any) -> None:
        """Add a callback instance or class (a class is instantiated without arguments).

        A second callback of a class already present is added too, with HF's warning: two
        early-stopping callbacks, say, are usually a configuration mistake.
        """
        cb = callback() if isinstance(callback, type) else callback
        if any(same_kind(type(existing), type(cb)) for existing in self.callbacks):
            log.warning("You are adding a %s to the callbacks of this Trainer, but there is already one. "
                        "The current list of callbacks is:\n%s", type(cb).__name__, self.callback_list)
        self.callbacks.append(cb)
        self._dispatch: dict[str, list] = {}

    # -- state in checkpoints ---------------------------------------------------------

    def export_states(self, control: TrainerControl) -> dict[str, Any]:
        """``stateful_callbacks`` for trainer_state.json: each ExportableState callback's
        ``state()`` by class name (a list when several share a class), and the control."""
        out: dict[str, Any] = {}
        for cb in [*self.callbacks, control]:
            if not isinstance(cb, ExportableState):
                continue
            name = type(cb).__name__
            if name in out:
                out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [cb.state()]
            else:
                out[name] = cb.state()
        return out

    def restore_states(self, saved: dict[str, Any], control: TrainerControl) -> TrainerControl:
        """Rebuild the stateful callbacks (and the control) from a checkpoint's ``stateful_callbacks``.

        Each is made anew from its saved constructor ``args``, then its ``attributes`` are set,
        as HF does; instances of one class pair with the saved states in order, and keep their
        place in the list. Saved states with no callback of that class here are ignored with a
        warning. Returns the control to use.
        """
        missing = []
        for name, data in saved.items():
            states = data if isinstance(data, list) else [data]
            if name == type(control).__name__:
                control = _rebuilt(type(control), states[0])
                continue
            positions = [i for i, cb in enumerate(self.callbacks) if type(cb).__name__ == name]
            if not positions:
                missing.append(name)
                continue
            for index, state in zip(positions, states):
                self.callbacks[index] = _rebuilt(type(self.callbacks[index]), state)
            self._dispatch = {}
        if missing:
            trainer_log.warning("Checkpoint included callbacks not included in current configuration. Ignoring. (%s)",
                        ", ".join(missing))
        return control

    def pop_callback(self, callback: Any) -> Any | None:
        """Remove and return the callback (an instance, or the first of a class)."""
        found = self._find(callback)
        if found is not None:
            self.callbacks.remove(found)
            self._dispatch = {}
        return found

    def remove_callback(self, callback: Any) -> None:
        """Remove the callback (an instance, or the first of a class)."""
        self.pop_callback(callback)

    def _find(self, callback: Any) -> Any | None:
        """The callback itself, or the first one of the class (HF: subclasses count) or of
        its counterpart in the other family (``transformers.DefaultFlowCallback`` finds
        workbench's, and the other way round)."""
        for cb in self.callbacks:
            if isinstance(callback, type):
                if isinstance(cb, callback) or same_kind(type(cb), callback):
                    return cb
            elif cb is callback:
                return cb
        return None

    @property
    def callback_list(self) -> str:
        """Names of the callbacks, one a line."""
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    # -- dispatch ---------------------------------------------------------------------

    def call_event(self, event: str, args, state, control, **kwargs) -> TrainerControl:
        """Call ``event`` on each callback implementing it; returns the (maybe replaced) control."""
        targets = self._dispatch.get(event)
        if targets is None:
            targets = [getattr(cb, event) for cb in self.callbacks if _implements(cb, event)]
            self._dispatch[event] = targets
        if not targets:
            return control
        # Built once per event, not once per callback: this runs several times a step.
        kwargs = {"model": self.model, "processing_class": self.processing_class, "optimizer": self.optimizer,
                  "lr_scheduler": self.lr_scheduler, "train_dataloader": self.train_dataloader,
                  "eval_dataloader": self.eval_dataloader, **kwargs}
        for hook in targets:
            result = hook(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control

    def has_hook(self, event: str) -> bool:
        """Whether any callback implements ``event`` (lets the loop skip building kwargs)."""
        targets = self._dispatch.get(event)
        if targets is None:
            targets = [getattr(cb, event) for cb in self.callbacks if _implements(cb, event)]
            self._dispatch[event] = targets
        return bool(targets)

    # The named hooks, in transformers' signatures, so code calling them keeps working.
    def on_init_end(self, args, state, control):
        return self.call_event(Event.ON_INIT_END, args, state, control)

    def on_train_begin(self, args, state, control):
        control.should_training_stop = False
        return self.call_event(Event.ON_TRAIN_BEGIN, args, state, control)

    def on_train_end(self, args, state, control):
        return self.call_event(Event.ON_TRAIN_END, args, state, control)

    def on_epoch_begin(self, args, state, control):
        control.should_epoch_stop = False
        return self.call_event(Event.ON_EPOCH_BEGIN, args, state, control)

    def on_epoch_end(self, args, state, control):
        return self.call_event(Event.ON_EPOCH_END, args, state, control)

    def on_step_begin(self, args, state, control):
        control.should_log = False
        control.should_evaluate = False
        control.should_save = False
        return self.call_event(Event.ON_STEP_BEGIN, args, state, control)

    def on_pre_optimizer_step(self, args, state, control):
        return self.call_event(Event.ON_PRE_OPTIMIZER_STEP, args, state, control)

    def on_optimizer_step(self, args, state, control):
        return self.call_event(Event.ON_OPTIMIZER_STEP, args, state, control)

    def on_substep_end(self, args, state, control):
        return self.call_event(Event.ON_SUBSTEP_END, args, state, control)

    def on_step_end(self, args, state, control):
        return self.call_event(Event.ON_STEP_END, args, state, control)

    def on_evaluate(self, args, state, control, metrics):
        control.should_evaluate = False
        return self.call_event(Event.ON_EVALUATE, args, state, control, metrics=metrics)

    def on_predict(self, args, state, control, metrics):
        return self.call_event(Event.ON_PREDICT, args, state, control, metrics=metrics)

    def on_save(self, args, state, control):
        control.should_save = False
        return self.call_event(Event.ON_SAVE, args, state, control)

    def on_push_begin(self, args, state, control):
        return self.call_event(Event.ON_PUSH_BEGIN, args, state, control)

    def on_log(self, args, state, control, logs):
        control.should_log = False
        return self.call_event(Event.ON_LOG, args, state, control, logs=logs)

    def on_prediction_step(self, args, state, control):
        return self.call_event(Event.ON_PREDICTION_STEP, args, state, control)

    def on_error(self, args, state, control, error):
        return self.call_event(Event.ON_ERROR, args, state, control, error=error)


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate and save from the *_strategy / *_steps arguments."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and _due(step, state.logging_steps):
            control.should_log = True
        if args.eval_strategy == "steps" and _due(step, state.eval_steps) and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and _due(step, state.save_steps):
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # HF's last step: evaluate unless this step already does (eval_delay permitting), and
            # save with save_strategy "steps"; it logs only if it is a logging step (the rest
            # of the loss goes into train_loss). "epoch" saves in on_epoch_end, right after.
            if args.eval_strategy == "steps" and not _due(step, state.eval_steps) and args.eval_delay <= step:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
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
    loss, LR, samples/s, ETA) and one per evaluation, on the main process only. It is the
    default unless ``disable_tqdm``; ``max_str_len`` is accepted for HF compatibility."""

    def __init__(self, max_str_len: int = 100, stream: TextIO | None = None) -> None:
        self.max_str_len = max_str_len
        self.stream = stream
        self._start: float | None = None
        self._start_step = 0
        self._world = 1

    def _write(self, text: str) -> None:
        self.stream = print_line(text, self.stream)

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._start_step = state.global_step
        self._world = int(os.environ.get("WORLD_SIZE", "1"))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if any(k.startswith(("eval_", "test_")) for k in logs):
            return  # evaluations print in on_evaluate
        if "train_runtime" in logs:
            self._write(
                f"done: {state.global_step} steps in {_clock(logs['train_runtime'])}"
                f" | train_loss {logs.get('train_loss', float('nan')):.4f}"
                f" | {logs.get('train_samples_per_second', 0):.1f} samples/s"
            )
            return
        elapsed = time.perf_counter() - (self._start or time.perf_counter())
        done = state.global_step - self._start_step
        remaining = state.max_steps - state.global_step
        eta = elapsed / done * remaining if done > 0 else float("nan")
        parts = [f"step {state.global_step}/{state.max_steps}", f"epoch {state.epoch:.2f}"]
        if "loss" in logs:
            parts.append(f"loss {logs['loss']:.4f}")
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.3g}")
        if "grad_norm" in logs:
            parts.append(f"grad_norm {logs['grad_norm']:.3g}")
        if done > 0 and state.train_batch_size:
            samples = done * state.train_batch_size * args.gradient_accumulation_steps * self._world
            parts.append(f"{samples / elapsed:.1f} samples/s")
        parts.append(f"elapsed {_clock(elapsed)}")
        parts.append(f"ETA {_clock(eta)}" if math.isfinite(eta) else "ETA ?")
        self._write(" | ".join(parts))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or not metrics:
            return
        shown = [
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in metrics.items()
            if not is_timing_metric(k) and k != "epoch"  # the step is in the line already
        ]
        self._write(f"eval @ step {state.global_step}: " + " | ".join(shown))


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


def _rebuilt(cls: type, state: dict[str, Any]) -> Any:
    instance = cls(**state.get("args", {}))
    for key, value in state.get("attributes", {}).items():
        setattr(instance, key, value)
    return instance


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
