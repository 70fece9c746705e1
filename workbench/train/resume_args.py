"""Resuming with other arguments than the checkpoint was saved with.

A checkpoint brings back the optimizer (its learning rate and weight decay), the schedule
and the TrainerState (its logging/eval/save intervals), so without this module a resume
with ``save_steps=3, learning_rate=0.5`` would quietly go on saving every 2 steps at 0.1.
The rule, applied once at the resume step (never per step):

* Each argument of :data:`COMPARED` is compared with the checkpoint's
  ``training_args.json`` (the arguments of the launch that wrote it). Every difference is
  one warning line on the ``transformers.trainer_utils`` logger (rank 0), as HF's
  ``compare_trainer_and_checkpoint_args`` warns (workbench's wording: the launch's value
  wins here where HF keeps the checkpoint's).
* The live-editable ones (``learning_rate``, ``max_steps``, ``num_train_epochs``,
  ``logging_steps``, ``eval_steps``, ``save_steps``) take effect from the resume step,
  through the same ``apply_edit`` a Session's ``set()`` uses, and are recorded as one
  ``workbench_state.live_edits`` entry (``{"step", "time", key: value, ...}``) so the run's
  history and later resumes see them.
* The others only warn, saying what happens instead (e.g. a new batch size shifts the data
  position).

Comparing with the checkpoint's *launch* arguments, not with its live values, is what
keeps a Session's live edits across a plain resume: relaunching the same command finds no
difference, and the edited values come back with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from workbench.core.edits import EDITABLE, apply_edit
from workbench.core.run import Run


log = logging.getLogger("transformers.trainer_utils")  # where HF warns about changed arguments

__all__ = ["COMPARED", "checkpoint_arguments", "apply_changed_arguments", "replace_arguments"]


# The arguments a resume compares, in the order their warnings are printed.
COMPARED: tuple[str, ...] = (
    "learning_rate",
    "max_steps",
    "num_train_epochs",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "lr_scheduler_type",
    "weight_decay",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "data_seed",
)

_DATA_POSITION = ("used from here on, but the batches already consumed are skipped counted in the new size, "
                  "so the data position may shift")
_DATA_ORDER = ("the samplers are seeded with it, so the data order changes and the rest of this epoch "
               "may repeat or skip examples; the restored random states carry on")
# What happens to a difference that is not applied as a live edit.
_ONLY_WARNED = {
    "lr_scheduler_type": ("not a live edit: the schedule is rebuilt with this type at the restored step count; the "
                          "first update after the resume still uses the restored rate, the next ones the new shape"),
    "weight_decay": ("used from here on: the optimizer state is restored, and each parameter group takes this "
                     "run's weight decay"),
    "per_device_train_batch_size": _DATA_POSITION,
    "gradient_accumulation_steps": _DATA_POSITION,
    "seed": _DATA_ORDER,
    "data_seed": _DATA_ORDER,
}


def checkpoint_arguments(checkpoint: Path) -> dict[str, Any] | None:
    """The compared arguments ``checkpoint``'s launch used, from its ``training_args.json``.

    Not trainer_state.json's intervals, which HF compares: those carry the run's live edits,
    and comparing with them would undo a Session's edits at every plain resume. Every
    checkpoint that verifies has the file (it is written with the rest); None if unreadable.
    """
    try:
        data = json.loads((checkpoint / "training_args.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {key: data[key] for key in COMPARED if key in data}


def _interval(value: Any, max_steps: int) -> int | None:
    """A logging/eval/save interval in steps (a ratio below 1 is of max_steps, as HF resolves it)."""
    if value is None:
        return None
    return max(1, math.ceil(max_steps * value) if value < 1 else int(value))


def _edits_for(trainer: Run, changed: list[str], planned_max_steps: int) -> dict[str, Any]:
    """The live edits that carry this launch's values of the ``changed`` editable arguments."""
    args = trainer.args
    edits: dict[str, Any] = {}
    if "learning_rate" in changed:
        edits["learning_rate"] = float(args.learning_rate)
    if "max_steps" in changed or "num_train_epochs" in changed:
        # The run's length is one thing however it is given: max_steps decides when set (as
        # in planning), else the epochs do.
        if args.max_steps > 0:
            edits["max_steps"] = int(args.max_steps)
        elif getattr(trainer, "_updates_per_epoch", None):
            edits["num_train_epochs"] = args.num_train_epochs
    for key in ("logging_steps", "eval_steps", "save_steps"):
        steps = _interval(getattr(args, key), planned_max_steps) if key in changed else None
        if steps is not None:
            edits[key] = steps
    return edits


def _note(key: str, applied: dict[str, Any], refused: bool, step: int, args: Any) -> str:
    """What this launch does about one difference (the end of its warning line)."""
    if key in _ONLY_WARNED:
        return _ONLY_WARNED[key]
    if key in ("max_steps", "num_train_epochs"):
        if key == "num_train_epochs" and args.max_steps > 0:
            return "no effect: max_steps decides the run's length"
        if refused:
            return f"this launch's end is not after step {step}: the run ends at once"
        if applied.keys() & {"max_steps", "num_train_epochs"}:
            return f"the run's length follows it from step {step} (recorded as a live edit)"
    elif key in applied:
        return f"applied from step {step} (recorded as a live edit)"
    return "nothing to apply (this launch has no value for it)"


def apply_changed_arguments(trainer: Run, checkpoint: Path, planned_max_steps: int) -> dict[str, Any]:
    """Warn about each compared argument that differs from ``checkpoint``'s, and apply the
    live-editable ones from the resume step as one recorded live edit.

    Called by the training loop right after the checkpoint is restored (and its own live
    edits replayed), on every process alike; only rank 0 warns and writes the event log.
    ``planned_max_steps`` is the length this launch's arguments plan, which interval ratios
    refer to. Returns the applied edit (empty when nothing was applied).
    """
    values = checkpoint_arguments(checkpoint)
    if values is None:
        return {}
    args, state = trainer.args, trainer.state
    current = args.to_dict()
    changed = [key for key in COMPARED if key in values and current.get(key) != values[key]]
    if not changed:
        return {}
    edits = _edits_for(trainer, [k for k in changed if k in EDITABLE], planned_max_steps)
    applied: dict[str, Any] = {}
    refused = False
    # The length goes first: it is the one edit that can be refused (an end before this step).
    for key, value in sorted(edits.items(), key=lambda kv: kv[0] not in ("max_steps", "num_train_epochs")):
        try:
            applied[key] = apply_edit(trainer, key, value)
        except ValueError:
            if key not in ("max_steps", "num_train_epochs"):
                raise
            refused = True
            state.max_steps = planned_max_steps  # as before this rule: a run past its end stops at once
    step = state.global_step
    if trainer.is_world_process_zero():
        for key in changed:
            log.warning("resuming from %s: %s is %r in this launch but %r in its training_args.json; %s",
                        checkpoint.name, key, current.get(key), values[key], _note(key, applied, refused, step, args))
    if applied:
        trainer.workbench_state.live_edits.append({"step": step, "time": time.time(), **applied})
        if trainer.is_world_process_zero():
            from workbench.core.event_file import EventFile

            EventFile(args.output_dir).write("edit", step, checkpoint=checkpoint.name, **applied)
    return applied


def replace_arguments(trainer: Run, **overrides: Any) -> None:
    """Give ``trainer`` new TrainingArguments with ``overrides`` for its next ``train()``.

    Validated as at construction (a new TrainingArguments is made). Only the arguments a
    resume compares (:data:`COMPARED`) can change this way: the others shaped what the
    Trainer built once (its Accelerator, output folder, callbacks), which a new Trainer
    is for. Used by ``Session.resume_from(checkpoint, **overrides)``.
    """
    unknown = sorted(set(overrides) - set(COMPARED))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: cannot change on an existing Trainer; these can: "
                         f"{', '.join(COMPARED)} (or build a new Trainer / use Session.branch)")
    trainer.args = dataclasses.replace(trainer.args, **overrides)
    trainer._train_batch_size = trainer.args.train_batch_size
