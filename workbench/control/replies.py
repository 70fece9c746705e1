"""The read replies, encoded from the run's published copies once, shared, and bounded in size.

Many clients polling one run ask the same questions about the same snapshot, and a run
publishes a new snapshot ~10 times a second, mostly equal to the last one. So the pieces of
a reply are encoded once per object the Session publishes and kept: the catalog rows, the
interventions and the edits of a snapshot (the Session hands over the same objects until
they change), each event, and each (step, value) point of the curves. A poll then costs
the server a few lookups, joins and a send. The curves matter most: ``json.dumps`` of three
2,000-point series is ~40 ms of float formatting on a loaded machine, in one C call that
holds the GIL (the training thread waits it out), and the curves change with every log;
encoded point by point from the cache, a new version of them is one join per series.

Every reply stays under the line limit whatever the run's history: a snapshot carries the
newest SNAPSHOT_CHECKPOINTS catalog rows (each with its newest few edits, see
workbench.core.records.ROW_EDITS), a failed run's error and traceback cut to MAX_TEXT, and is
trimmed further if it would still be over FIELDS_BUDGET; ``events`` and ``checkpoints list``
replies are pages cut by size (``more`` says another page follows); one event over
MAX_EVENT_BYTES has its long texts cut.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields as dataclass_fields
from typing import Any

from workbench.control.protocol import downsample, event_to_dict, snapshot_to_dict, to_json
from workbench.door.values import Snapshot

__all__ = ["ReplyCache", "ok_line", "map_json", "page", "bounded_fields", "SNAPSHOT_CHECKPOINTS", "PAGE_BYTES",
           "MAX_EVENT_BYTES", "FIELDS_BUDGET", "MAX_TEXT"]

SNAPSHOT_CHECKPOINTS = 100  # catalog rows in a snapshot reply (the newest, and the best): `checkpoints` has all
PAGE_BYTES = 256 * 1024  # an events or checkpoints page stops growing past this
MAX_EVENT_BYTES = 64 * 1024  # one event's encoding; longer texts in a bigger one are cut
FIELDS_BUDGET = 512 * 1024  # a snapshot's fields (the curves aside) are trimmed to fit this
MAX_TEXT = 20_000  # characters of a failed run's error or traceback a snapshot carries
_CUT_TEXT = 2_000  # what an oversized reply keeps of each long text
_PARTS = ("checkpoints", "interventions", "edits", "proposals")  # a snapshot's lists, encoded once per object
_SCALARS = tuple(f.name for f in dataclass_fields(Snapshot) if f.name not in {*_PARTS, "series", "memory", "status"})
_MAX_POINTS = 200_000  # encoded points kept (a few runs' curves; cleared when over)


def ok_line(ident: int, result: bytes) -> bytes:
    """The reply line ``{"id": ident, "ok": true, "result": <result>}`` around encoded ``result``."""
    return b'{"id":%d,"ok":true,"result":%b}\n' % (ident, result)


def map_json(items: Iterable[tuple[str, Any]]) -> bytes:
    """A JSON object encoded entry by entry: no single C call holds the GIL for the whole map."""
    return b"{" + b",".join(to_json(key) + b":" + to_json(value) for key, value in items) + b"}"


def page(pieces: Sequence[bytes], budget: int = PAGE_BYTES) -> int:
    """How many of ``pieces`` (encoded items, in order) fit in one page of ``budget`` bytes
    (at least one, so a page always moves on)."""
    size = 0
    for count, piece in enumerate(pieces):
        size += len(piece) + 1
        if size > budget and count:
            return count
    return len(pieces)


def _cut(value: Any, limit: int) -> Any:
    """``value`` with every string over ``limit`` characters cut (nested dicts and lists too)."""
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + f"... ({len(value) - limit} characters cut)"
    if isinstance(value, dict):
        return {k: _cut(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut(v, limit) for v in value]
    return value


def _texts(data: dict[str, Any]) -> dict[str, Any]:
    """A failed run's error and traceback cut to MAX_TEXT (a traceback keeps its end: what failed)."""
    if data.get("error"):
        data["error"] = _cut(data["error"], MAX_TEXT)
    tb = data.get("traceback")
    if tb and len(tb) > MAX_TEXT:
        data["traceback"] = f"... ({len(tb) - MAX_TEXT} characters cut)\n" + tb[-MAX_TEXT:]
    return data


def _rows(rows: Sequence[Any]) -> list[Any]:
    """The catalog rows a snapshot carries: the newest SNAPSHOT_CHECKPOINTS, and the best."""
    if len(rows) <= SNAPSHOT_CHECKPOINTS:
        return list(rows)
    older = rows[:-SNAPSHOT_CHECKPOINTS]
    return [r for r in older if getattr(r, "best", False)] + list(rows[-SNAPSHOT_CHECKPOINTS:])


def bounded_fields(snap: Any) -> dict[str, Any]:
    """A snapshot's fields but its curves, as plain data that fits FIELDS_BUDGET encoded (the
    slow path, for a snapshot the cached pieces made too big: the lists shrink, counts stay)."""
    data = _texts(snapshot_to_dict(snap, series=False))
    data["checkpoints"] = [r.to_dict() for r in _rows(snap.checkpoints)]
    if len(to_json(data)) <= FIELDS_BUDGET:
        return data
    data["trimmed"] = True
    data["edits"] = [_cut(e, 200) for e in data["edits"][-10:]]
    data["checkpoints"] = [{**r, "edits": [], "metrics": dict(list(r.get("metrics", {}).items())[:20])}
                           for r in data["checkpoints"][-20:]]
    data["interventions"] = [{**i.to_dict(), "samples": list(i.samples[:64])} for i in data["interventions"][-32:]]
    data = _cut(data, _CUT_TEXT)
    if len(to_json(data)) > FIELDS_BUDGET:
        data.update(edits=[], checkpoints=[], interventions=[], traceback=None)
    return data


def _number(value: Any) -> bytes:
    if isinstance(value, float) and not math.isfinite(value):
        return b"NaN" if value != value else b"Infinity" if value > 0 else b"-Infinity"
    return repr(value).encode()


class ReplyCache:
    """Encoded results of the read commands, shared by every client (the reactor's thread only)."""

    def __init__(self) -> None:
        self._fields: tuple[Any, bytes] | None = None  # (snapshot, its fields encoded)
        self._parts: dict[str, tuple[Any, bytes]] = {}  # a snapshot list's identity key -> its encoding
        self._points: dict[tuple, bytes] = {}
        self._series: collections.OrderedDict[tuple, tuple[Any, bytes]] = collections.OrderedDict()
        self._events: collections.OrderedDict[int, tuple[Any, bytes]] = collections.OrderedDict()

    # -- snapshots ---------------------------------------------------------------------------------

    def fields(self, snap: Any) -> bytes:
        """``snap``'s fields but the curves, encoded once per published snapshot (its lists
        once per list object)."""
        cached = self._fields
        if cached is not None and cached[0] is snap:
            return cached[1]
        scalars = _texts({name: getattr(snap, name) for name in _SCALARS})
        scalars["status"] = str(snap.status)
        scalars["memory"] = snap.memory.to_dict() if snap.memory is not None else None
        rows = snap.checkpoints
        parts = [(b"checkpoints", self._part("checkpoints", rows, lambda: [r.to_dict() for r in _rows(rows)])),
                 (b"interventions", self._part("interventions", snap.interventions,
                                               lambda: [i.to_dict() for i in snap.interventions])),
                 # the Session builds a new edits tuple per snapshot; its newest edit names it
                 (b"edits", self._part("edits", (len(snap.edits), snap.edit_count,
                                                 snap.edits[-1].get("time") if snap.edits else None),
                                       lambda: [dict(e) for e in snap.edits], by_value=True)),
                 # the run hands out the same proposals tuple until one changes (session/proposals.py)
                 (b"proposals", self._part("proposals", snap.proposals, lambda: [p.to_dict() for p in snap.proposals]))]
        data = to_json(scalars)[:-1] + b"".join(b',"%b":%b' % (k, v) for k, v in parts) + b"}"
        if len(data) > FIELDS_BUDGET:
            data = to_json(bounded_fields(snap))
        self._fields = (snap, data)
        return data

    def _part(self, name: str, key: Any, build: Any, by_value: bool = False) -> bytes:
        hit = self._parts.get(name)
        if hit is None or (hit[0] != key if by_value else hit[0] is not key):
            hit = self._parts[name] = (key, to_json(build()))
        return hit[1]

    # -- curves ---------------------------------------------------------------------------------------

    def _curve(self, points: Sequence[tuple[int, float]]) -> bytes:
        cache = self._points
        try:
            return b"[" + b",".join(map(cache.__getitem__, points)) + b"]"
        except KeyError:
            if len(cache) > _MAX_POINTS:
                cache.clear()
            for point in points:
                if point not in cache:
                    cache[point] = b"[%b,%b]" % (_number(point[0]), _number(point[1]))
            return b"[" + b",".join(map(cache.__getitem__, points)) + b"]"

    def series(self, series: Mapping[str, Sequence], points: int | None = None,
               names: Sequence[str] | None = None) -> bytes:
        """The curves (each thinned to ``points``; only ``names`` if given), once per series
        object, each point encoded once in its life."""
        if points is not None and points >= max(map(len, series.values()), default=0):
            points = None  # nothing to thin: the same bytes as the whole curves
        key = (id(series), points, tuple(names) if names is not None else None)
        hit = self._series.get(key)
        if hit is None or hit[0] is not series:  # the object is kept with its bytes: its id stays its own
            chosen = [(k, downsample(v, points) if points else v) for k, v in series.items()
                      if names is None or k in names]
            encoded = b"{" + b",".join(to_json(k) + b":" + self._curve(v) for k, v in chosen) + b"}"
            hit = self._series[key] = (series, encoded)
            while len(self._series) > 8:
                self._series.popitem(last=False)
        return hit[1]

    # -- events ------------------------------------------------------------------------------------------

    def event(self, event: Any) -> bytes:
        """One event encoded (its long texts cut if it is over MAX_EVENT_BYTES)."""
        hit = self._events.get(id(event))
        if hit is None or hit[0] is not event:
            data = to_json(event_to_dict(event))
            if len(data) > MAX_EVENT_BYTES:
                shrunk = event_to_dict(event)
                shrunk["data"] = {**_cut(shrunk["data"], _CUT_TEXT), "cut": True}
                data = to_json(shrunk)
                if len(data) > MAX_EVENT_BYTES:
                    data = to_json({**shrunk, "data": {"cut": True, "note": "this event's data is too big to send"}})
            hit = self._events[id(event)] = (event, data)
            while len(self._events) > 4096:
                self._events.popitem(last=False)
        return hit[1]

    def events_page(self, events: Sequence[Any], total: int) -> tuple[bytes, int]:
        """``{"events": [...], "cursor": c, "more": bool}`` for the events after a cursor
        (``events`` as events_since returned them, ``total`` its cursor), cut to one page;
        returns the encoded result and the cursor it ends at."""
        pieces, size = [], 0
        for event in events:
            piece = self.event(event)
            size += len(piece) + 1
            if size > PAGE_BYTES and pieces:
                break
            pieces.append(piece)
        cursor = total - len(events) + len(pieces)
        more = b"true" if len(pieces) < len(events) else b"false"
        return b'{"events":[%b],"cursor":%d,"more":%b}' % (b",".join(pieces), cursor, more), cursor
