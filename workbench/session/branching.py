"""Branching a run: the checks a branch must pass, and the Trainer it starts with.

Kept apart from the Session's thread and commands: the checks are plain functions a form
can call before anything is stopped, and the rebuild only reads the parent Trainer.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for annotations only: the Trainer is a layer below, and heavy to import
    from workbench.train.trainer import Trainer


__all__ = ["check_branch", "check_new_folder", "check_resume_overrides", "branch_trainer"]


def check_branch(args: Any, step: int, output_dir: str | Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides of a branch from the parent's checkpoint at ``step``, validated.

    Refused, with a one-line ValueError: an empty output_dir; the parent's own output_dir (the
    branch's checkpoints, rotation and lock would mix with the parent's); anything but a new or
    empty folder (a file; a folder holding anything, checkpoints or not: the branch writes its
    lock, endpoint and event log there, and a resume there would pick the wrong run); unknown
    argument names, values of the wrong type and invalid combinations (TrainingArguments' own
    checks, the learning-rate rule among them). Every door (the Session, the forms, a remote
    client) applies this same rule before anything stops.
    """
    from workbench.config.loader import check_training_overrides

    check_new_folder("branch", args.output_dir, output_dir, f"{Path(args.output_dir).resolve()}-branch-{step}")
    try:
        checked = check_training_overrides(overrides, args_cls=type(args))
        dataclasses.replace(args, output_dir=str(output_dir), **checked)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"branch: {exc}") from None
    return checked


def check_new_folder(command: str, parent: str | Path, output_dir: str | Path, suggestion: str,
                     what: str = "a branch") -> Path:
    """``output_dir`` as a new or empty folder of its own for what ``command`` writes (a branch,
    a saved fork variant: ``what``), resolved; a one-line ValueError naming ``suggestion``: an
    empty name, the run's own output_dir (checkpoints, rotation and lock would mix), a file, a
    folder holding anything (a resume there would pick the wrong run). Else the path, resolved."""
    if not str(output_dir).strip():
        raise ValueError(f"{command}: output_dir is empty; give it a folder of its own (e.g. {suggestion})")
    target = Path(output_dir).resolve()
    if target == Path(parent).resolve():
        raise ValueError(f"{command}: {output_dir} is this run's own output_dir; {what} needs a folder of its "
                         f"own (e.g. {suggestion})")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{command}: {output_dir} is a file; {what} needs a new or empty folder (e.g. {suggestion})")
    held = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"{command}: {output_dir} is not empty (it holds {shown}); {what} needs a new or empty "
                         f"folder (e.g. {suggestion})")
    return target


def check_resume_overrides(args: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides of a resume (``resume_from(checkpoint, **overrides)``), validated without
    changing anything: only the arguments a resume compares (train/resume_args.py COMPARED),
    with values TrainingArguments accepts. So a remote restart is refused before the run stops."""
    from workbench.config.loader import check_training_overrides
    from workbench.train.resume_args import COMPARED

    try:
        checked = check_training_overrides(overrides, args_cls=type(args))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"resume_from: {exc}") from None
    unknown = sorted(set(checked) - set(COMPARED))
    if unknown:
        raise ValueError(f"resume_from: {', '.join(unknown)} cannot change on a resume; these can: "
                         f"{', '.join(COMPARED)} (branch into a new folder for the others)")
    try:
        dataclasses.replace(args, **checked)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"resume_from: {exc}") from None
    return checked


def branch_trainer(old: "Trainer", checkpoint: str | Path, output_dir: str | Path,
                   overrides: dict[str, Any]) -> tuple["Trainer", dict[str, Any]]:
    """A Trainer for the branch (a copy of the parent's model, its data and hooks, the
    parent's user callbacks) and the branch's origin record, also written to the branch's
    events.jsonl. The parent keeps its own weights."""
    from workbench.core.event_file import EventFile
    from workbench.train.trainer import Trainer
    from workbench.core.trainer_utils import unwrap_model

    args = dataclasses.replace(old.args, output_dir=str(output_dir), **overrides)
    model = copy.deepcopy(unwrap_model(old.model))
    user_callbacks = [cb for cb in old.callback_handler.callbacks if type(cb).__module__.split(".")[0] != "workbench"]
    trainer = Trainer(model=model, args=args, data_collator=old.data_collator, train_dataset=old.train_dataset,
                      eval_dataset=old.eval_dataset, processing_class=old.processing_class,
                      compute_loss_func=old.compute_loss_func, compute_metrics=old.compute_metrics,
                      callbacks=user_callbacks, preprocess_logits_for_metrics=old.preprocess_logits_for_metrics)
    origin = {"checkpoint": str(Path(checkpoint).resolve()), "overrides": overrides,
              "parent_output_dir": str(Path(old.args.output_dir).resolve())}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    EventFile(output_dir).write("branch", 0, **origin)
    return trainer, origin
