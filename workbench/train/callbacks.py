"""Callbacks: the hooks of the HF Trainer, its state and control objects, and built-ins.

``Event`` values are the hook method names, so dispatch is ``getattr(callback, event)``
and a callback written for transformers' Trainer works here by duck typing. The handler
precomputes, per event, only the callbacks that implement it: a hook nobody overrides
costs nothing on the hot path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from workbench.records import is_timing_metric

log = logging.getLogger("workbench")

__all__ = [
    "Event",
    "TrainerState",
    "TrainerControl",
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


class ExportableState:
    """Mixin for callbacks whose state is saved in checkpoints (HF's ExportableState)."""

    def state(self) -> dict:
        """``{"args": constructor kwargs, "attributes": mutable state}``."""
        raise NotImplementedError("stateful callbacks implement state()")

    @classmethod
    def from_state(cls, state: dict) -> "ExportableState":
        """Rebuild the callback from what ``state()`` returned."""
        instance = cls(**state["args"])
        for key, value in state["attributes"].items():
            setattr(instance, key, value)
        return instance


# TrainerState fields of workbench's own, kept out of trainer_state.json (see to_json_string).
WORKBENCH_STATE_FIELDS = ("live_edits", "loss_window", "guard")
WORKBENCH_STATE_NAME = "workbench_state.json"


@dataclass
class TrainerState:
    """What the loop knows about the run; saved as trainer_state.json in checkpoints."""

    epoch: float = 0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    # workbench: live hyperparameter edits applied during the run, replayed on resume.
    live_edits: list[dict[str, Any]] = field(default_factory=list)
    # workbench: the training loss not yet logged (since step ``since_step``), so a resumed
    # run logs the same values as an uninterrupted one.
    loss_window: dict[str, Any] | None = None
    # workbench: the guard's interventions and detector state (train/guard.py), so a resumed
    # run repeats the uninterrupted one's decisions.
    guard: dict[str, Any] | None = None

    def to_json_string(self) -> str:
        """The HF fields as indented JSON: trainer_state.json, which transformers' Trainer
        reads as it is (its TrainerState takes no unknown keys, so workbench's go elsewhere)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in WORKBENCH_STATE_FIELDS}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def extras_json_string(self) -> str:
        """workbench's own fields (live edits, the unlogged loss) for ``workbench_state.json``."""
        data = {k: getattr(self, k) for k in WORKBENCH_STATE_FIELDS}
        return json.dumps({"format": 1, **data}, indent=2, sort_keys=True) + "\n"

    def save_to_json(self, json_path: str) -> None:
        """Write trainer_state.json, and workbench_state.json beside it."""
        path = Path(json_path)
        path.write_text(self.to_json_string(), encoding="utf-8")
        (path.parent / WORKBENCH_STATE_NAME).write_text(self.extras_json_string(), encoding="utf-8")

    @classmethod
    def load_from_json(cls, json_path: str) -> "TrainerState":
        """Read trainer_state.json (written here or by transformers; unknown keys ignored) and
        workbench_state.json beside it when there is one (older checkpoints kept those
        fields in trainer_state.json itself)."""
        path = Path(json_path)
        data = json.loads(path.read_text(encoding="utf-8"))
        extras = path.parent / WORKBENCH_STATE_NAME
        if extras.is_file():
            data.update({k: v for k, v in json.loads(extras.read_text(encoding="utf-8")).items()
                         if k in WORKBENCH_STATE_FIELDS})
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """Resolve logging/eval/save steps given as ratios of ``max_steps`` (HF rule)."""
        for name in ("logging", "eval", "save"):
            value = getattr(args, f"{name}_steps")
            if value is None:
                continue
            steps = math.ceil(max_steps * value) if value < 1 else int(value)
            setattr(self, f"{name}_steps", max(1, steps))


@dataclass
class TrainerControl(ExportableState):
    """Flags callbacks set to steer the loop; the loop resets them after acting. Saved in
    checkpoints with the stateful callbacks, as in HF."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    def state(self) -> dict:
        """The flags, as ``{"args": ..., "attributes": {}}`` (HF's ExportableState form)."""
        return {"args": dataclasses.asdict(self), "attributes": {}}


class TrainerCallback:
    """Base class with every hook of the HF Trainer; override the ones you need.

    Hooks receive ``(args, state, control, **kwargs)`` with kwargs such as model,
    optimizer, lr_scheduler, train_dataloader, eval_dataloader, metrics, logs. Returning a
    ``TrainerControl`` replaces the control object, as in transformers.
    """

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
        if any(type(existing) is type(cb) for existing in self.callbacks):
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
            log.warning("Checkpoint included callbacks not included in current configuration. Ignoring. (%s)",
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
        for cb in self.callbacks:
            if (isinstance(callback, type) and type(cb) is callback) or cb is callback:
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
        print(text, file=self.stream or sys.stdout, flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        import os

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
            if not is_timing_metric(k)
        ]
        self._write(f"eval @ step {state.global_step}: " + " | ".join(shown))


class PrinterCallback(TrainerCallback):
    """HF's bare printer: each log dict as it is (floats as ``.4g``, without total_flos), on
    the local main process. The Trainer uses it instead of ProgressCallback with ``disable_tqdm``."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_local_process_zero or not logs:
            return
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
        print(shown, flush=True)


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
