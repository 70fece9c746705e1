"""A ``transformers.TrainingArguments`` given to workbench's Trainer, as workbench's own.

A user who swaps only the Trainer keeps building HF's arguments object. It is read field
by field into a :class:`workbench.TrainingArguments` (validated as any other); the user's
object is never changed. HF's objects are recognised by their class, without importing
transformers (it is optional, and the core does not load it).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

from workbench.core.args.training import ArgumentError, TrainingArguments

__all__ = ["is_hf_training_arguments", "as_workbench_arguments"]


def is_hf_training_arguments(obj: Any) -> bool:
    """Whether ``obj`` is transformers' TrainingArguments (or a subclass such as
    Seq2SeqTrainingArguments), recognised by the classes it is made from."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, (type, TrainingArguments)) and any(
        klass.__name__ == "TrainingArguments" and klass.__module__.split(".")[0] == "transformers"
        for klass in type(obj).__mro__)


def _plain(value: Any) -> Any:
    """A value of HF's object as workbench's constructor takes it: enums as their values,
    AcceleratorConfig as a dict, everything copied (the user's object stays as it is)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and hasattr(value, "to_dict") and not isinstance(value, type):
        return copy.deepcopy(value.to_dict())
    return copy.deepcopy(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def as_workbench_arguments(args: Any) -> Any:
    """``args`` unchanged unless it is transformers' TrainingArguments; then workbench's,
    with every field's value carried over.

    A field only HF's class (or the user's subclass of it) has, set away from its default,
    is refused with one line naming it; so is any value workbench does not serve (its
    ArgumentError, e.g. ``push_to_hub``).
    """
    if not is_hf_training_arguments(args):
        return args
    ours = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    kind = type(args).__name__
    values: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        if not f.init:
            continue
        value = getattr(args, f.name)
        if f.name in ours:
            values[f.name] = _plain(value)
        elif _plain(value) != _plain(_default(f)):
            raise ArgumentError(f.name, f"this field of {kind} is not served by workbench's Trainer (set to "
                                        f"{value!r}); unset it, or use transformers' Trainer")
    try:
        return TrainingArguments(**values)
    except ArgumentError as exc:
        raise ArgumentError(exc.key, f"{exc.reason} (from the {kind} given to workbench's Trainer)") from None
