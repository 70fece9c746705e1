"""The control protocol: newline-delimited JSON, one message a line (PROTOCOL_VERSION 1).

Request: ``{"id": n, "cmd": "...", "args": {...}}``. Reply: ``{"id": n, "ok": true,
"result": ...}`` or ``{"id": n, "ok": false, "error": "one line", "kind": "ValueError"}``
(``kind`` lets a client raise the same exception type the Session raised). A subscribed
connection also receives ``{"event": {...}, "cursor": n}`` lines. Lines are capped at
MAX_LINE bytes in both directions, so neither side can be made to buffer without bound.

``snapshot`` polls: ``since`` (the ``updated`` of the client's last snapshot) answers
``{"unchanged": true}`` when nothing changed. ``series_since`` (the ``series_version`` of
the client's last full reply) answers ``"series_unchanged": true`` without the curves when
they have not changed, or ``series_delta`` (see series_delta.py) with what changed, so a
10 Hz poller costs the run a few kB a poll, not its 2,000-point series; ``series_delta: 2``
says the client also reads deltas with inserted points (a long run's thinned history).
All are optional: a client that sends none gets every field every time, and a server
that predates them ignores them (they are an additive part of version 1).

Also here: the plain-data conversions of the session's value types (Snapshot, SessionEvent)
to JSON and back, and the series downsampling the server applies before sending.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import fields as dataclass_fields
from typing import Any

from workbench.door.values import CheckpointRow, Intervention, MemoryUsage, Proposal, SessionEvent, Snapshot, Status

__all__ = ["PROTOCOL_VERSION", "MAX_LINE", "COMMANDS", "ProtocolError", "to_json", "encode", "decode_request",
           "decode_reply", "reply_ok", "reply_error", "snapshot_to_dict", "snapshot_from_dict",
           "event_to_dict", "event_from_dict", "downsample"]

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 20  # 1 MiB: a longer line is a protocol error (the connection is closed)

# Every command the server answers (server.py maps each to a Session method).
COMMANDS = frozenset({
    "hello", "status", "snapshot", "events", "series", "arguments", "memory",
    "pause", "resume", "stop", "save", "evaluate", "validate", "set", "inspect", "sample",
    "checkpoints", "parse_overrides", "check_branch", "lr_plan", "fork", "fork_cost", "keep", "discard",
    "save_variant",
    "propose", "proposals", "decide",
})


class ProtocolError(ValueError):
    """A message that breaks the protocol (not JSON, too long, wrong shape)."""


def to_json(value: Any) -> bytes:
    """``value`` as compact JSON bytes (no newline, no limit): the pieces replies are made of.
    NaN/inf are written as JSON5-style ``NaN``/``Infinity`` (Python's json reads them back):
    a diverged loss must still be reportable."""
    return json.dumps(value, separators=(",", ":"), default=_plain).encode("utf-8")


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as a JSON line (see to_json); ProtocolError over MAX_LINE."""
    data = to_json(message) + b"\n"
    if len(data) > MAX_LINE:
        raise ProtocolError(f"message of {len(data)} bytes is over the {MAX_LINE}-byte line limit")
    return data


def _plain(value: Any) -> Any:
    """JSON for what json cannot write itself: paths, enums, tuples of dataclasses."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "__fspath__"):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return repr(value)


def _load(line: bytes | str) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line of {len(line)} bytes is over the {MAX_LINE}-byte limit")
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not a JSON line ({exc})") from None
    except RecursionError:  # a line of 5,000 nested brackets: refused, never a traceback
        raise ProtocolError("not a JSON line (nested too deeply)") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a JSON object, got {type(message).__name__}")
    return message


def decode_request(line: bytes | str) -> tuple[int, str, dict[str, Any]]:
    """``(id, cmd, args)`` of a request line; ProtocolError when it has the wrong shape."""
    message = _load(line)
    ident, cmd, args = message.get("id"), message.get("cmd"), message.get("args", {})
    if isinstance(ident, bool) or not isinstance(ident, int):
        raise ProtocolError("request: 'id' must be an integer")
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError("request: 'cmd' must be a command name")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError("request: 'args' must be an object")
    return ident, cmd, args


def decode_reply(line: bytes | str) -> dict[str, Any]:
    """A reply or event line as a dict (checked to be an object)."""
    return _load(line)


def reply_ok(ident: int, result: Any) -> dict[str, Any]:
    return {"id": ident, "ok": True, "result": result}


def reply_error(ident: int | None, error: BaseException | str) -> dict[str, Any]:
    """An error reply: the first line of the message only (the Session's errors are one line)."""
    if isinstance(error, BaseException):
        text, kind = str(error) or type(error).__name__, type(error).__name__
    else:
        text, kind = error, "ProtocolError"
    return {"id": ident, "ok": False, "error": text.splitlines()[0] if text else kind, "kind": kind}


# -- value types <-> JSON ---------------------------------------------------------------------


_DEEP = frozenset({"memory", "checkpoints", "edits", "series", "proposals"})  # fields snapshot_to_dict converts itself


def snapshot_to_dict(snap: Snapshot, series: bool = True) -> dict[str, Any]:
    """A Snapshot as plain data (``series=False`` leaves the curves out: status polls stay small).

    The series are handed over as they are (tuples of (step, value) tuples, which json
    writes as arrays), not copied: a deep copy of 2,000 points per series cost the run's
    process ~30 ms a poll. The snapshot's series are never mutated, so sharing them is safe."""
    data = {f.name: getattr(snap, f.name) for f in dataclass_fields(snap) if f.name not in _DEEP}
    data["status"] = str(snap.status)
    data["memory"] = snap.memory.to_dict() if snap.memory is not None else None
    data["checkpoints"] = [row.to_dict() for row in snap.checkpoints]
    data["edits"] = [dict(e) for e in snap.edits]
    data["series"] = dict(snap.series) if series else {}
    data["proposals"] = [p.to_dict() for p in snap.proposals]
    return data


def snapshot_from_dict(data: Mapping[str, Any], series: Mapping[str, tuple] | None = None) -> Snapshot:
    """The Snapshot a server sent (unknown keys ignored, so a newer server still works).

    ``series``: the curves to use instead of the message's own (a reply that left them out
    because the client already had them: see ``series_since`` in the module docstring)."""
    fields = dict(data)
    fields["status"] = Status(fields.get("status", "idle"))
    if series is None:
        series = {k: tuple((int(s), float(v)) for s, v in pts) for k, pts in (fields.get("series") or {}).items()}
    fields["series"] = series
    memory = fields.get("memory")
    fields["memory"] = MemoryUsage.from_dict(memory) if memory else None
    fields["checkpoints"] = tuple(CheckpointRow.from_dict(r) for r in fields.get("checkpoints") or ())
    fields["edits"] = tuple(dict(e) for e in fields.get("edits") or ())
    fields["interventions"] = tuple(Intervention.from_record(r) for r in fields.get("interventions") or ())
    fields["lr_plan"] = tuple((int(s), float(v)) for s, v in fields.get("lr_plan") or ())
    fields["proposals"] = tuple(Proposal.from_dict(p) for p in fields.get("proposals") or ())
    known = Snapshot.__dataclass_fields__
    return Snapshot(**{k: v for k, v in fields.items() if k in known})


def event_to_dict(event: SessionEvent) -> dict[str, Any]:
    return {"kind": event.kind, "step": event.step, "time": event.time, "data": event.data}


def event_from_dict(data: Mapping[str, Any]) -> SessionEvent:
    return SessionEvent(kind=str(data["kind"]), step=int(data["step"]), time=float(data["time"]),
                        data=dict(data.get("data") or {}))


def downsample(points: Sequence[tuple[int, float]], limit: int) -> list[tuple[int, float]]:
    """At most ``limit`` points spread evenly over ``points``, the first and last kept
    (the run's side thins a curve so a remote chart gets only what it can draw). The points
    themselves are not copied: json writes the (step, value) tuples as arrays."""
    n = len(points)
    if limit <= 0:
        return []
    if n <= limit:
        return list(points)
    if limit == 1:
        return [points[-1]]
    picks = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
    return [points[i] for i in picks]
