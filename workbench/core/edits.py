"""Live edits: the one rule for each editable hyperparameter, and how an edit is applied.

An edit (learning rate or LR scale, step intervals, max_steps, epochs, a change of the
schedule's shape: core/schedule_edits.py) is validated here,
once, whoever asks for it: the Session, a front-end's form, a remote client, a rank
following rank 0, a resume that replays the run's edits, the guard's ``lr_backoff``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from workbench.core.args.values import check_learning_rate, learning_rate_problem  # noqa: F401 - part of this module's API
from workbench.core.event_file import EventFile
from workbench.core.records import RECORD_FIELDS, edit_changes  # noqa: F401 - part of this module's API
from workbench.core.schedule_edits import install_schedule, parse_schedule, rebuild_schedules, resolve_schedule

if TYPE_CHECKING:
    from workbench.core.run import Run


__all__ = ["EDITABLE", "RECORD_FIELDS", "MAX_REASON", "check_reason", "edit_changes", "learning_rate_problem",
           "check_learning_rate", "parse_edit", "validate_edits", "apply_edit", "record_edit", "replay_edits"]


def _positive_number(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return check


def _positive_int(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive whole number, got {value!r}")
    return check


# The live edits and the check of each one's value (the same checks whoever asks).
EDITABLE: dict[str, Callable[[Any], None]] = {
    "learning_rate": check_learning_rate,
    "lr_scale": _positive_number("lr_scale"),
    "max_steps": _positive_int("max_steps"),
    "num_train_epochs": _positive_number("num_train_epochs"),
    "logging_steps": _positive_int("logging_steps"),
    "eval_steps": _positive_int("eval_steps"),
    "save_steps": _positive_int("save_steps"),
    # A change of the schedule's shape (decay_now, extend, rewarm, scale_peak): core/schedule_edits.py.
    "schedule": parse_schedule,
}
# The type a value typed as text is read as (a form field, a remote command).
_WHOLE = ("max_steps", "logging_steps", "eval_steps", "save_steps")


# The keys of a live-edit record that are not edits: when and why it was made.
MAX_REASON = 500  # characters: a reason is a sentence for the record, not a log


def check_reason(reason: Any) -> str | None:
    """A decision's reason as stored with its edit (one line, stripped), or None for none.

    Agents steering a run say why (``set(lr_scale=0.5, reason="eval loss flat for 3
    evaluations")``); the reason is kept in the live-edit record and the ``edit`` event, so
    a run's history reads as decisions, not just numbers. ValueError with one line when it
    is not text or too long."""
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise ValueError(f"reason: expected text, got {type(reason).__name__}")
    text = " ".join(reason.split())  # one line: events.jsonl and the dashboard show it as one
    if len(text) > MAX_REASON:
        raise ValueError(f"reason: {len(text)} characters is over the {MAX_REASON}-character limit")
    return text or None


def parse_edit(key: str, value: Any) -> Any:
    """One live edit's value, checked; text (as typed into a form) is read as a number first.

    Raises ValueError with one line naming the key and the problem; returns the value as
    it will be applied (an int for step counts, a float or int otherwise).
    """
    if key not in EDITABLE:
        import difflib

        close = difflib.get_close_matches(key, EDITABLE, n=1, cutoff=0.6)  # a typo gets its fix named
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"{key}: not editable live{hint}; editable: {', '.join(EDITABLE)}")
    if key == "schedule":  # an operation and its arguments (a dict, or text as typed)
        return parse_schedule(value)
    if isinstance(value, str):
        text = value.strip()
        whole = key in _WHOLE
        if not text:
            raise ValueError(f"{key}: type {'a whole number' if whole else 'a number'}, e.g. "
                             f"{'100' if whole else '1e-4' if key == 'learning_rate' else '0.5'}")
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise ValueError(f"{key}: {text!r} is not {'a whole number' if whole else 'a number'}") from None
    EDITABLE[key](value)
    return value


def validate_edits(changes: Mapping[str, Any], current_step: int = 0) -> dict[str, Any]:
    """A set of live edits, checked together; returns them parsed (see parse_edit).

    Besides each value's own check: at least one change, the learning rate set or scaled
    (not both: which would apply first?), and max_steps not below ``current_step``. Raises
    ValueError with one line. Checked again when applied (the step moves meanwhile).
    """
    if not changes:
        raise ValueError(f"nothing to change: give at least one of {', '.join(EDITABLE)}")
    parsed = {key: parse_edit(key, value) for key, value in changes.items()}
    if "learning_rate" in parsed and "lr_scale" in parsed:
        raise ValueError("set the learning rate or scale it, not both")
    # A schedule change sets the rate and (decay_now, extend) max_steps itself: which would win?
    clashing = [k for k in ("learning_rate", "lr_scale", "max_steps", "num_train_epochs") if k in parsed]
    if "schedule" in parsed and clashing:
        raise ValueError(f"schedule: change the schedule or {clashing[0]}, not both in one edit")
    if "max_steps" in parsed and parsed["max_steps"] < current_step:
        raise ValueError(f"max_steps: {parsed['max_steps']} is below the current step {current_step}")
    return parsed


def _set_base_lrs(run: "Run", base_lrs: list[float]) -> None:
    """Set the rates the schedule scales from, and the current rates to match at once."""
    scheduler = run.lr_scheduler
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
    if scheduler is None or optimizer is None:
        raise ValueError("learning_rate: the optimizer does not exist yet; start the run first")
    factors = [lr / base if base else 0.0 for lr, base in zip(scheduler.get_last_lr(), scheduler.base_lrs)]
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(optimizer.param_groups, base_lrs, factors):
        group["initial_lr"] = base
        group["lr"] = base * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def apply_edit(run: "Run", key: str, value: Any) -> Any:
    """Apply one live edit at a step boundary; returns the value applied."""
    value = parse_edit(key, value)
    state = run.state
    if key == "learning_rate":
        _set_base_lrs(run, [float(value)] * len(run.lr_scheduler.base_lrs))
    elif key == "lr_scale":
        _set_base_lrs(run, [base * float(value) for base in run.lr_scheduler.base_lrs])
    elif key == "schedule":
        # Resolved against this point of the run; the record keeps the resolved numbers, so
        # the other ranks and a resume apply exactly this.
        value = resolve_schedule(run, value)
        if value["op"] == "scale_peak":
            _set_base_lrs(run, [base * float(value["factor"]) for base in run.lr_scheduler.base_lrs])
        else:
            install_schedule(run, value)
    elif key == "max_steps":
        if value < state.global_step:
            raise ValueError(f"max_steps: {value} is below the current step {state.global_step}")
        state.max_steps = int(value)
        per_epoch = run.updates_per_epoch
        if per_epoch:
            state.num_train_epochs = math.ceil(state.max_steps / per_epoch)
    elif key == "num_train_epochs":
        # Optimizer steps per epoch, as the loop planned them (max_steps / num_train_epochs is
        # not it when max_steps is not a whole number of epochs).
        per_epoch = run.updates_per_epoch
        if not per_epoch:
            raise ValueError("num_train_epochs: this run has no epoch length (streaming data, or not "
                             "started); edit max_steps")
        new_max = math.ceil(per_epoch * value)
        if new_max < state.global_step:
            raise ValueError(f"num_train_epochs: {value} epochs end before the current step {state.global_step}")
        state.max_steps = new_max
        state.num_train_epochs = math.ceil(value)
    else:  # logging_steps / eval_steps / save_steps: the flow callback reads them from the state
        setattr(state, key, int(value))
    return value


def record_edit(run: "Run", record: dict[str, Any]) -> dict[str, Any]:
    """Record a live edit once it is applied: ``record`` (``{"step", "time", key: value, ...,
    "reason"?, "memory"?}``) joins the run's live edits (a checkpoint carries them, a resume
    replays them), becomes an ``edit`` event in events.jsonl (rank 0, as ``watch`` and a finished
    run's readers see it) and is told to ``run.edit_listeners`` (a Session: its snapshot's edits
    and an ``edited`` event, which the dashboard, the panel and ``ctl`` show). One path, so an
    edit the run makes itself (an out-of-memory recovery) reaches them as a front-end's does."""
    run.workbench_state.live_edits.append(record)
    if run.is_world_process_zero():
        fields = {k: v for k, v in record.items() if k not in ("step", "time")}
        EventFile(run.args.output_dir).write("edit", record["step"], **fields)
    for listener in list(run.edit_listeners):
        listener(record)
    return record


def replay_edits(run: "Run") -> None:
    """After a resume: re-apply the edits that the restored files do not already carry.

    The schedule's base rates come back with scheduler.pt and the step intervals with
    trainer_state.json; max_steps is recomputed from the arguments on resume, so the last
    edited value (of max_steps, or of num_train_epochs converted to steps) is put back here.
    """
    per_epoch = run.updates_per_epoch
    for edit in run.workbench_state.live_edits:
        for key, value in edit.items():  # in the order they were applied
            if key == "max_steps":
                run.state.max_steps = int(value)
            elif key == "num_train_epochs" and per_epoch:
                run.state.max_steps = math.ceil(per_epoch * value)
            elif key == "schedule" and isinstance(value, Mapping) and "new_max_steps" in value:
                run.state.max_steps = int(value["new_max_steps"])
    # The schedule's shape changes are closures scheduler.pt does not hold: built again here.
    rebuild_schedules(run)
