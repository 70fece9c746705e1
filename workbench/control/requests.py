"""Every command's arguments, checked before anything runs (the server's one place for it).

A request is checked whole, against its command's schema, before the Session hears of it:
an unknown argument, a value of the wrong type or out of range, a missing one, all answer
an error reply with one line naming the argument, and nothing has happened. (Before this
schema, ``set`` with a bad ``timeout`` replied ok:false after queuing the edit, and ``save``
with ``timeout: -1`` after writing the checkpoint.) The Session still checks what only it
can know (the current step, the checkpoint folder, the model); this module checks what a
request can get wrong by itself.

``check_request(cmd, args)`` returns the arguments with every default filled in, so a
handler reads ``args["timeout"]`` without a second look.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from workbench.door.commands import check_sample_options
from workbench.core.edits import check_reason, parse_edit
from workbench.door.proposals import MAX_SOURCE

__all__ = ["MAX_WAIT_S", "check_request", "SCHEMAS", "CHECKPOINT_ACTIONS"]

MAX_WAIT_S = 600.0  # the longest a request may wait for a queued command
_REQUIRED = object()
Check = Callable[[str, Any], Any]


def _shown(value: Any) -> str:
    """A value as an error line shows it: its repr, cut short (a request can carry 1 MiB)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {_shown(value)}")
    return value


def _number(low: float, high: float) -> Check:
    def check(key: str, value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not low <= value <= high):
            raise ValueError(f"{key}: expected a number from {low:g} to {high:g}, got {_shown(value)}")
        return float(value)
    return check


def _whole(low: int, high: int) -> Check:
    def check(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key}: expected a whole number from {low} to {high}, got {_shown(value)}")
        return value
    return check


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected text, got {_shown(value)}")
    return value


def _name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key}: expected a name such as checkpoint-40 (see checkpoints list), got {_shown(value)}")
    return value


def _client(key: str, value: Any) -> str:
    """Who connects (door/endings.py's CLIENTS: ctl, attach, remote); another name is a client
    this version does not know, told as a script is."""
    from workbench.door.endings import CLIENTS

    return value if isinstance(value, str) and value in CLIENTS else "remote"


def _optional(check: Check) -> Check:
    return lambda key, value: None if value is None else check(key, value)


def _names(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{key}: expected a list of series names, got {_shown(value)}")
    return value


def _reason(key: str, value: Any) -> str | None:
    return check_reason(value)  # the Session's own rule: text, one line, at most MAX_REASON characters


def _schedule(key: str, value: Any) -> dict[str, Any]:
    return parse_edit("schedule", value)  # a schedule change: the one rule (core/schedule_edits.py)


def _variants(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not value or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(f"{key}: expected the variants by name, e.g. {{\"a\": {{\"learning_rate\": 1e-3}}, \"b\": {{}}}}")
    for name, changes in value.items():
        for item, setting in changes.items():
            try:
                parse_edit(item, setting)  # each variant's edits by the one rule per key
            except ValueError as exc:
                raise ValueError(f"{key}: {name}: {exc}") from None
    return value


def _changes(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{key}: expected the changes as an object, e.g. {{\"learning_rate\": 1e-4}}")
    for name, item in value.items():
        parse_edit(name, item)  # the one rule per key: an unknown key or a bad value is refused here
    return value


# Names a resume's or branch's overrides cannot take: the command's own arguments.
_OWN_ARGUMENTS = ("checkpoint", "output_dir", "save", "other_run")


def _overrides(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected an object of training arguments, e.g. {{\"learning_rate\": 1e-4}}")
    for name in value:
        if name in _OWN_ARGUMENTS or not name.isidentifier():
            raise ValueError(f"{key}: {_shown(name)} is not a training argument to override")
    return value


def _override_text(key: str, value: Any) -> str | dict[str, str]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    raise ValueError(f"{key}: expected \"KEY=VALUE, ...\" or an object of texts, got {_shown(value)}")


def _source(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_SOURCE:
        raise ValueError(f"{key}: expected a short name such as autopilot/plateau (at most {MAX_SOURCE} "
                         f"characters), got {_shown(value)}")
    return value


_WAIT = {"wait": (_boolean, True), "timeout": (_number(0.0, MAX_WAIT_S), 120.0)}

# Per command: argument -> (check, default); _REQUIRED marks an argument a request must give.
SCHEMAS: dict[str, dict[str, tuple[Check, Any]]] = {
    "hello": {"token": (_optional(_text), None), "client": (_optional(_client), None)},
    "status": {}, "arguments": {}, "memory": {}, "inspect": {}, "resume": {},
    "snapshot": {"since": (_optional(_number(0.0, math.inf)), None), "series": (_boolean, True),
                 "series_since": (_optional(_text), None), "series_delta": (_optional(_whole(1, 2)), None)},
    "events": {"cursor": (_whole(0, 2**62), 0), "subscribe": (_boolean, False)},
    "series": {"points": (_whole(1, 100_000), 200), "names": (_optional(_names), None)},
    "pause": {"wait": (_boolean, False), "timeout": (_number(0.0, MAX_WAIT_S), 60.0)},
    "stop": {"save": (_boolean, True)},
    "save": dict(_WAIT), "evaluate": dict(_WAIT),
    "validate": {"changes": (_changes, _REQUIRED), "reason": (_reason, None)},
    "set": {"changes": (_changes, _REQUIRED), "reason": (_reason, None), **_WAIT},
    "lr_plan": {"schedule": (_optional(_schedule), None)},
    # A/B forks from the paused run (session/fork_commands.py); a fork trains, so it may take a while.
    "fork": {"variants": (_variants, _REQUIRED), "steps": (_whole(1, 100_000), _REQUIRED), "evaluate": (_boolean, True),
             "max_memory": (_optional(_whole(0, 2**62)), None)},
    "fork_cost": {"variants": (_variants, _REQUIRED), "steps": (_whole(1, 100_000), _REQUIRED),
                  "max_memory": (_optional(_whole(0, 2**62)), None)},
    "keep": {"name": (_text, _REQUIRED), "reason": (_reason, None)},
    "discard": {},
    "save_variant": {"name": (_text, _REQUIRED), "output_dir": (_optional(_text), None), "reason": (_reason, None)},
    # proposals (session/proposals.py): changes put on the run for anyone attached to decide
    "propose": {"changes": (_changes, _REQUIRED), "reason": (_reason, None), "source": (_optional(_source), None)},
    "proposals": {},
    "decide": {"id": (_whole(1, 2**62), _REQUIRED), "accept": (_boolean, _REQUIRED), "reason": (_reason, None)},
    # sample's own options are checked together (check_sample_options), below
    "sample": {"prompt": (_text, _REQUIRED), "max_new_tokens": (None, 64), "temperature": (None, 0.8),
               "top_k": (None, 20), "seed": (None, 0)},
    "parse_overrides": {"text": (_override_text, _REQUIRED)},
    "check_branch": {"checkpoint": (_name, _REQUIRED), "output_dir": (_text, _REQUIRED),
                     "overrides": (_overrides, {}), "other_run": (_boolean, False)},
}
# checkpoints: one schema per action (an argument of another action is refused too).
CHECKPOINT_ACTIONS: dict[str, dict[str, tuple[Check, Any]]] = {
    "list": {"offset": (_whole(0, 2**31), 0)},
    "delete": {"name": (_name, _REQUIRED)},
    # other_run: the checkpoint may be another run's (the Session refuses one outside this
    # run's output_dir otherwise, before anything stops)
    "resume_from": {"checkpoint": (_name, _REQUIRED), "overrides": (_overrides, {}), "other_run": (_boolean, False),
                    **_WAIT},
    "branch": {"checkpoint": (_name, _REQUIRED), "output_dir": (_text, _REQUIRED), "overrides": (_overrides, {}),
               "save": (_boolean, True), "other_run": (_boolean, False), **_WAIT},
}


def _apply(what: str, schema: Mapping[str, tuple[Check | None, Any]], args: Mapping[str, Any],
           skip: tuple[str, ...] = ()) -> dict[str, Any]:
    unknown = sorted(k for k in args if k not in schema and k not in skip)
    if unknown:
        takes = f"it takes {', '.join(sorted(schema))}" if schema else "it takes no arguments"
        raise ValueError(f"{what}: unknown argument {_shown(unknown[0])}; {takes}")
    checked: dict[str, Any] = {}
    for key, (check, default) in schema.items():
        if key not in args:
            if default is _REQUIRED:
                raise ValueError(f"{what}: {key} is missing")
            checked[key] = dict(default) if isinstance(default, dict) else default
        else:
            checked[key] = args[key] if check is None else check(key, args[key])
    return checked


def check_request(cmd: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` of command ``cmd`` checked whole and completed with defaults; ValueError with
    one line (naming the argument) for anything wrong, before anything has been done."""
    if cmd == "checkpoints":
        action = args.get("action", "list")
        schema = CHECKPOINT_ACTIONS.get(action) if isinstance(action, str) else None
        if schema is None:
            raise ValueError(f"checkpoints: unknown action {_shown(action)}; use {', '.join(CHECKPOINT_ACTIONS)}")
        return {"action": action, **_apply(f"checkpoints {action}", schema, args, skip=("action",))}
    schema = SCHEMAS.get(cmd)
    if schema is None:
        raise ValueError(f"unknown command {_shown(cmd)}; known: {', '.join(sorted([*SCHEMAS, 'checkpoints']))}")
    checked = _apply(cmd, schema, args)
    if cmd == "sample":
        options = {k: checked[k] for k in ("max_new_tokens", "temperature", "top_k", "seed")}
        checked.update(check_sample_options(checked["prompt"], **options))
    return checked
