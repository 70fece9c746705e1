"""The callback protocol of the HF Trainer: the hooks (``TrainerCallback``), their event names
(``Event``) and the handler that calls them in order (``CallbackHandler``).

``Event`` values are the hook method names, so dispatch is ``getattr(callback, event)``
and a callback written for transformers' Trainer works here by duck typing. The handler
precomputes, per event, only the callbacks that implement it: a hook nobody overrides
costs nothing on the hot path. Callbacks observe and set ``TrainerControl`` flags; what
steers the loop from outside (a pause, the rank agreement, a stop) is a gate (gates.py).
The built-in callbacks (DefaultFlowCallback, the printers, early stopping) live in
workbench/train/callbacks.py.
"""

from __future__ import annotations

import abc
import enum
import logging
from typing import Any

from workbench.core.state import ExportableState, TrainerControl, is_hf_class

# The warnings transformers' Trainer gives come out on its loggers' names, with its wording,
# so the handlers and verbosity settings of HF users and tools apply to them as well.
log = logging.getLogger("transformers.trainer_callback")
trainer_log = logging.getLogger("transformers.trainer")

__all__ = ["Event", "TrainerCallback", "CallbackHandler", "SHARED_CALLBACKS", "same_kind", "rebuilt_callback"]

# Where workbench's built-in callbacks live (named, not imported: they are a layer above).
BUILTINS_MODULE = "workbench.train.callbacks"


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
    # workbench additions: a run that fails, so sinks can record the error; the answers a
    # SamplesCallback generated (train/samples.py), so sinks and the Session show them.
    ON_ERROR = "on_error"
    ON_SAMPLE = "on_sample"


class TrainerCallback(abc.ABC):
    """Base class with every hook of the HF Trainer; override the ones you need.

    Hooks receive ``(args, state, control, **kwargs)`` with kwargs such as model,
    optimizer, lr_scheduler, train_dataloader, eval_dataloader, metrics, logs, and (a workbench
    addition) ``callback_handler``, through which a callback can tell the others something
    (``on_sample``). Returning a ``TrainerControl`` replaces the control object, as in transformers.

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
    def on_sample(self, args, state, control, samples=None, **kwargs): ...


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
    families = {BUILTINS_MODULE, "transformers.trainer_callback"}
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
                control = rebuilt_callback(type(control), states[0])
                continue
            positions = [i for i, cb in enumerate(self.callbacks) if type(cb).__name__ == name]
            if not positions:
                missing.append(name)
                continue
            for index, state in zip(positions, states):
                self.callbacks[index] = rebuilt_callback(type(self.callbacks[index]), state)
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
                  "eval_dataloader": self.eval_dataloader, "callback_handler": self, **kwargs}
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

    def on_sample(self, args, state, control, samples):
        """``samples``: the answers of one sample point, ``[{"prompt", "answer", "tokens"}]``."""
        return self.call_event(Event.ON_SAMPLE, args, state, control, samples=samples)


def rebuilt_callback(cls: type, state: dict[str, Any]) -> Any:
    """A stateful callback (or the control) made anew from its saved ``state()``, as HF does."""
    instance = cls(**state.get("args", {}))
    for key, value in state.get("attributes", {}).items():
        setattr(instance, key, value)
    return instance
