"""Edits of the learning-rate schedule's shape, not only its rate: decay now, extend, rewarm,
scale the peak (issue 28).

A schedule change is a live edit like any other (``set(schedule={...})``, core/edits.py):
checked here, recorded with its reason, replayed on resume and applied by every rank. It is
made of plain numbers so that it can be all of these: when first applied it is *resolved*
against the run (the step it starts at, the rates it starts from and goes to, as ratios of
the base rate), and the resolved change is what the record keeps. Applying a resolved change
is a pure function of it and of the schedule before it, so rank 0, the other ranks and a
resumed run build the same multiplier, bit for bit.

The schedule is torch's ``LambdaLR``: the rate at scheduler step ``s`` is ``base * f(s)``.
A change wraps ``f`` in a new function ``g`` equal to ``f`` before the change's step ``t``
and following the change from ``t`` on, with ``g(t) == f(t)`` (the rate the next optimizer
step uses is unchanged: no jump) unless the change asks for one (``rewarm`` with ``steps=0``,
``scale_peak``). The wrappers are plain closures, which ``LambdaLR.state_dict`` leaves out of
``scheduler.pt``: a checkpoint stays weights-only loadable, and a resume rebuilds them from
the records (:func:`rebuild`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.core.run import Run

__all__ = ["SCHEDULE_OPS", "SCHEDULE_SHAPES", "parse_schedule", "resolve_schedule", "install_schedule",
           "rebuild_schedules", "planned_rates", "schedule_label"]

SCHEDULE_OPS = ("decay_now", "extend", "rewarm", "scale_peak")
SCHEDULE_SHAPES = ("linear", "cosine")
# Per operation: argument -> (kind, default); None marks an argument it must be given.
_ARGS: dict[str, dict[str, tuple[str, Any]]] = {
    "decay_now": {"steps": ("whole", None), "to": ("floor", 0.0), "shape": ("shape", "linear")},
    "extend": {"max_steps": ("whole", None)},
    "rewarm": {"steps": ("whole0", None), "peak": ("rate", None), "shape": ("shape", "cosine")},
    "scale_peak": {"factor": ("positive", None)},
}
# What resolving a change adds (numbers the record keeps, so a replay needs nothing else).
_RESOLVED = ("at", "from_ratio", "to_ratio", "peak_ratio", "end_ratio", "old_max_steps", "new_max_steps")
_EXAMPLE = "decay_now steps=200 to=min_lr shape=cosine"


def _problem(op: str, key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"schedule: {op} {key}: expected {expected}, got {value!r}")


def _read(op: str, key: str, kind: str, value: Any) -> Any:
    """One argument of a schedule change, checked (text as typed is read as a number first)."""
    if isinstance(value, str) and kind != "shape" and not (kind == "floor" and value.strip() == "min_lr"):
        text = value.strip()
        try:
            value = int(text) if kind in ("whole", "whole0") else float(text)
        except ValueError:
            raise _problem(op, key, "a number", text) from None
    if kind in ("whole", "whole0"):
        low = 1 if kind == "whole" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _problem(op, key, f"a whole number >= {low}", value)
        return value
    if kind == "shape":
        if value not in SCHEDULE_SHAPES:
            raise _problem(op, key, " or ".join(SCHEDULE_SHAPES), value)
        return value
    if kind == "floor" and value == "min_lr":
        return value
    number_ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if kind == "positive" and not (number_ok and value > 0):
        raise _problem(op, key, "a positive number", value)
    if kind in ("rate", "floor") and not (number_ok and value >= 0):
        expected = "a learning rate >= 0" if kind == "rate" else "a learning rate >= 0 or min_lr"
        raise _problem(op, key, expected, value)
    return float(value)


def _from_text(text: str) -> dict[str, Any]:
    """``"decay_now steps=200 to=min_lr"`` (spaces or commas between the words) as a dict."""
    words = text.replace(",", " ").split()
    if not words:
        raise ValueError(f"schedule: type an operation and its arguments, e.g. {_EXAMPLE}")
    change: dict[str, Any] = {"op": words[0]}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"schedule: expected KEY=VALUE after the operation (e.g. {_EXAMPLE}), got {word!r}")
        change[key] = value
    return change


def parse_schedule(value: Any) -> dict[str, Any]:
    """A schedule change checked: ``{"op": "decay_now", "steps": 200, ...}``, or text as typed
    (``"decay_now steps=200 to=min_lr shape=cosine"``). Returns it with defaults filled in;
    ValueError with one line naming the operation and argument otherwise.

    decay_now(steps, to=0 | "min_lr", shape="linear"): a cooldown from the current rate to
    ``to`` over ``steps`` steps, after which the run ends (max_steps = now + steps);
    extend(max_steps): the rest of the schedule stretched to end at ``max_steps``;
    rewarm(steps, peak, shape="cosine"): up to ``peak`` over ``steps`` steps (0: at once),
    then down to where the schedule was heading by max_steps; scale_peak(factor): the whole
    schedule scaled (what ``lr_scale`` does). A resolved change (from a record) also carries
    the numbers resolving added."""
    if isinstance(value, str):
        value = _from_text(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"schedule: expected an operation and its arguments, e.g. {_EXAMPLE}")
    op = value.get("op")
    if op not in _ARGS:
        raise ValueError(f"schedule: op {op!r} is not one of: {', '.join(SCHEDULE_OPS)}")
    spec = _ARGS[op]
    unknown = sorted(k for k in value if k != "op" and k not in spec and k not in _RESOLVED)
    if unknown:
        raise ValueError(f"schedule: {op} takes {', '.join(spec)}; not {unknown[0]!r}")
    change: dict[str, Any] = {"op": op}
    for key, (kind, default) in spec.items():
        if key not in value:
            if default is None:
                raise ValueError(f"schedule: {op} needs {key} (e.g. {_example(op)})")
            change[key] = default
        else:
            change[key] = _read(op, key, kind, value[key])
    for key in _RESOLVED:
        if key in value:
            item = value[key]
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
                raise _problem(op, key, "a number", item)
            change[key] = item
    return change


def _example(op: str) -> str:
    return {"decay_now": _EXAMPLE, "extend": "extend max_steps=2000", "rewarm": "rewarm steps=50 peak=3e-4",
            "scale_peak": "scale_peak factor=0.5"}[op]


def schedule_label(change: Mapping[str, Any]) -> str:
    """A change as one short phrase (``decay_now steps=200 to=min_lr shape=cosine``), for
    tables, the edit log and proposals."""
    args = " ".join(f"{k}={change[k]}" for k in _ARGS.get(change.get("op"), {}) if k in change)
    return f"{change.get('op')} {args}".strip()


# -- the multiplier of a change --------------------------------------------------------------


def _weight(shape: str, progress: float) -> float:
    """From 1 (at the change's start) to 0 (at its end) along ``shape``."""
    progress = min(max(progress, 0.0), 1.0)
    return 1.0 - progress if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def _wrapped(before: Callable[[float], float], change: Mapping[str, Any]) -> Callable[[float], float]:
    """The multiplier after ``change`` (resolved): ``before`` until its step, the change from it."""
    op, at = change["op"], change["at"]
    if op == "decay_now":
        steps, start, end, shape = change["steps"], change["from_ratio"], change["to_ratio"], change["shape"]

        def decay(step: float) -> float:
            if step < at:
                return before(step)
            return end + (start - end) * _weight(shape, (step - at) / steps)
        return decay
    if op == "extend":
        old, new = change["old_max_steps"], change["new_max_steps"]
        stretch = (old - at) / (new - at)

        def extended(step: float) -> float:
            if step < at:
                return before(step)
            return before(at + (step - at) * stretch)
        return extended
    # rewarm
    steps, start, peak, end, shape = (change["steps"], change["from_ratio"], change["peak_ratio"], change["end_ratio"],
                                      change["shape"])
    decay_steps = change["old_max_steps"] - at - steps

    def rewarmed(step: float) -> float:
        if step < at:
            return before(step)
        if step < at + steps:
            return start + (peak - start) * (step - at) / steps
        return end + (peak - end) * _weight(shape, (step - at - steps) / decay_steps)
    return rewarmed


def _scheduler(run: "Run") -> Any:
    scheduler = run.lr_scheduler
    if scheduler is None or run.optimizer is None:
        raise ValueError("schedule: the optimizer does not exist yet; start the run first")
    return scheduler


def _shaped(scheduler: Any, op: str) -> list[Callable[[float], float]]:
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        raise ValueError(f"schedule: {op} reshapes a step schedule; this run's ({type(scheduler).__name__}) steps on "
                         "evaluations (use scale_peak, or learning_rate)")
    return lambdas


def resolve_schedule(run: "Run", change: Mapping[str, Any]) -> dict[str, Any]:
    """``change`` (checked) with the numbers that fix it to this point of the run: the step it
    starts at (the scheduler's), the ratios of the base rate it starts from and goes to, the
    old and new max_steps. A change resolved already is returned as it is (the other ranks
    and a replay apply rank 0's numbers). ValueError with one line when it cannot apply here."""
    change = parse_schedule(change)
    op = change["op"]
    if op == "scale_peak" or "at" in change:
        return change
    scheduler = _scheduler(run)
    f = _shaped(scheduler, op)[0]
    at, total = int(scheduler.last_epoch), int(run.state.max_steps)
    base = scheduler.base_lrs[0]
    if op == "decay_now":
        to = f(total) if change["to"] == "min_lr" else (change["to"] / base if base else 0.0)
        return {**change, "at": at, "from_ratio": f(at), "to_ratio": to, "old_max_steps": total,
                "new_max_steps": at + change["steps"]}
    if op == "extend":
        if change["max_steps"] <= at:
            raise ValueError(f"schedule: extend max_steps={change['max_steps']} is not after the current step {at}")
        return {**change, "at": at, "old_max_steps": total, "new_max_steps": change["max_steps"]}
    # rewarm
    if at + change["steps"] >= total:
        raise ValueError(f"schedule: rewarm steps={change['steps']} leaves no steps to decay before max_steps {total}; "
                         "extend the run first")
    return {**change, "at": at, "from_ratio": f(at), "peak_ratio": change["peak"] / base if base else 0.0,
            "end_ratio": f(total), "old_max_steps": total, "new_max_steps": total}


def install_schedule(run: "Run", change: Mapping[str, Any], replay: bool = False) -> None:
    """Apply a resolved change: wrap every group's multiplier and (unless ``replay``, where
    the restored optimizer already holds them) set the current rates from it, then max_steps.
    ``scale_peak`` is left to core/edits.py: it scales the base rates (as ``lr_scale``), which
    come back with scheduler.pt."""
    scheduler = _scheduler(run)
    op = change["op"]
    if op == "scale_peak":
        return
    lambdas = _shaped(scheduler, op)
    scheduler.lr_lambdas = [_wrapped(f, change) for f in lambdas]
    if not replay:
        optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
        step = scheduler.last_epoch
        for group, base, g in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * g(step)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    new_max = int(change["new_max_steps"])
    if new_max != run.state.max_steps:
        run.state.max_steps = new_max
        if run.updates_per_epoch:
            run.state.num_train_epochs = math.ceil(new_max / run.updates_per_epoch)


def rebuild_schedules(run: "Run") -> None:
    """After a resume: wrap the fresh schedule in the run's recorded changes, in order (their
    max_steps is put back by replay_edits with the other max_steps edits)."""
    for record in run.workbench_state.live_edits:
        change = record.get("schedule")
        if isinstance(change, Mapping) and change.get("op") != "scale_peak" and "at" in change:
            scheduler = run.lr_scheduler
            scheduler.lr_lambdas = [_wrapped(f, change) for f in _shaped(scheduler, change["op"])]


def planned_rates(run: "Run", change: Mapping[str, Any] | None = None, points: int = 200,
                  ) -> tuple[tuple[int, float], ...]:
    """The learning rate (the first group's) at each remaining step of the run, as
    ``(global step, rate)`` on the axis of the logged ``learning_rate`` (the rate a step
    trained with is drawn at that step), thinned to about ``points``; with ``change``, what it
    would be after that change (nothing is applied). Empty for a schedule stepped on
    evaluations, or before the run has an optimizer."""
    scheduler = run.lr_scheduler
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if scheduler is None or not lambdas:
        if change is not None:
            _scheduler(run)
            _shaped(scheduler, parse_schedule(change)["op"])
        return ()
    f, base, total = lambdas[0], scheduler.base_lrs[0], run.state.max_steps
    if change is not None:
        resolved = resolve_schedule(run, change)
        if resolved["op"] == "scale_peak":
            base = base * resolved["factor"]
        else:
            f, total = _wrapped(f, resolved), int(resolved["new_max_steps"])
    at = int(scheduler.last_epoch)
    if total <= at:
        return ()
    stride = max(1, math.ceil((total - at) / max(points, 2)))
    steps = list(range(at, total, stride))
    if steps[-1] != total - 1:
        steps.append(total - 1)
    offset = run.state.global_step - at  # a loss scaler's skipped steps leave the scheduler behind
    return tuple((s + 1 + offset, base * f(s)) for s in steps)
