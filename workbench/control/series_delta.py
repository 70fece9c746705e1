"""Series deltas: what a polling client needs to turn the curves it has into the run's newest.

A run's series are bounded (workbench.door.values.SeriesStore): an evenly thinned history
followed by the most recent points. Between two polls the history usually keeps its points
(and perhaps gains one) and the recent window slides by the few points logged meanwhile,
so the new curve is *a prefix of the old one, then a suffix of the old one, then new
points*. Sending only that (``[prefix_len, suffix_start, new_points]`` per series) keeps a
10 Hz poll at a few hundred bytes however long the run, where the whole curves are ~90 kB
(and ~7 ms of the run's CPU to encode). Once the history keeps every 2nd, 4th, ... point,
it also takes a few of the points that left the recent window, which sit between the
prefix and the suffix: those come as a fourth element, ``[a, b, new_points, inserted]``,
to a client that says it reads them (``series_delta=2`` in its snapshot request; one that
predates it gets the 3-element form only).
Without it, such a poll carried the whole recent window (500 points a series: ~40 kB). When
the history was thinned again (the rare halving), or anything else does not fit that
shape, the delta carries the whole curve: ``apply_delta(old, series_delta(old, new)) ==
new`` always holds.
"""

from __future__ import annotations

import bisect
import collections
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["series_delta", "apply_delta", "SeriesVersions"]

Points = Sequence[tuple[int, float]]
_BLOCK = 64


def _one(old: Points, new: Points, inserts: bool) -> list[Any]:
    """``[a, b, tail]`` with ``new == old[:a] + old[b:] + tail``, or (``inserts``) ``[a, b, tail,
    inserted]`` with ``new == old[:a] + inserted + old[b:] + tail`` (``[0, len(old), new]`` at worst)."""
    old, new = tuple(old), tuple(new)
    # The longest common prefix: whole blocks compared in C first (a store keeps its point
    # objects, so == short-cuts on identity), then point by point: ~20 µs for 2,000 points.
    a, limit = 0, min(len(old), len(new))
    while a + _BLOCK <= limit and old[a:a + _BLOCK] == new[a:a + _BLOCK]:
        a += _BLOCK
    while a < limit and old[a] == new[a]:
        a += 1
    if a == len(new):
        return [a, len(old), []]
    if a < len(old):
        # The kept suffix of old ends with its last point: find that in new by step (steps grow
        # along a curve), then match backwards; a repeated step at worst costs a longer tail.
        e = bisect.bisect_right(new, old[-1][0], lo=a, key=lambda p: p[0]) - 1
        n, kept, limit = len(old), 0, min(len(old) - a, e + 1 - a)
        while kept + _BLOCK <= limit and old[n - kept - _BLOCK:n - kept] == new[e + 1 - kept - _BLOCK:e + 1 - kept]:
            kept += _BLOCK
        while kept < limit and old[n - 1 - kept] == new[e - kept]:
            kept += 1
        c = e + 1 - kept  # where the kept suffix starts in new: new[a:c] was inserted before it
        if kept and (inserts or c == a):
            return [a, n - kept, list(new[e + 1:])] + ([list(new[a:c])] if c > a else [])
    return [a, len(old), list(new[a:])]


def series_delta(old: Mapping[str, Points], new: Mapping[str, Points], inserts: bool = True) -> dict[str, list[Any]]:
    """Per series of ``new``: ``[a, b, tail]`` such that ``old[name][:a] + old[name][b:] + tail``
    is ``new[name]``, or (``inserts``, for clients that read it) ``[a, b, tail, inserted]``
    with ``inserted`` between the two parts of ``old`` (a series that ``old`` lacks comes
    whole; one ``new`` lacks is dropped)."""
    return {name: _one(old.get(name, ()), points, inserts) for name, points in new.items()}


def apply_delta(old: Mapping[str, tuple], delta: Mapping[str, Sequence[Any]]) -> dict[str, tuple]:
    """The series ``series_delta(old, new)`` describes, rebuilt from ``old`` (ValueError when the
    delta does not fit ``old``: the client then asks for the whole curves)."""
    result: dict[str, tuple] = {}
    for name, (a, b, tail, *inserted) in delta.items():
        have = old.get(name, ())
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= len(have)) or len(inserted) > 1:
            raise ValueError(f"series delta for {name!r} does not fit the {len(have)} points held")
        middle = ((int(s), float(v)) for s, v in (inserted[0] if inserted else ()))
        result[name] = (*have[:a], *middle, *have[b:], *((int(s), float(v)) for s, v in tail))
    return result


class SeriesVersions:
    """The server's side of ``series_since``: a version name for each series object the run
    publishes (the Session keeps one object until a point is added, so equal names mean
    equal curves), and the last few objects, to answer a client with a delta from the
    version it holds. A random prefix keeps another run's version from ever matching."""

    def __init__(self, keep: int = 16) -> None:
        self._lock = threading.Lock()
        self._prefix = secrets.token_hex(4)
        self._count = 0
        self._current: tuple[Any, str] = (None, "")
        self._recent: collections.OrderedDict[str, Mapping[str, Points]] = collections.OrderedDict()
        self._keep = keep
        self._last_delta: tuple[str, str, bool, dict] | None = None  # pollers at one version share it

    def version(self, series: Mapping[str, Points]) -> str:
        """The name of this series object (a new one for each new object)."""
        with self._lock:
            if self._current[0] is not series:
                self._count += 1
                self._current = (series, f"{self._prefix}-{self._count}")
                self._recent[self._current[1]] = series
                while len(self._recent) > self._keep:
                    self._recent.popitem(last=False)
            return self._current[1]

    def reply(self, series: Mapping[str, Points], since: Any, inserts: bool = False) -> dict[str, Any]:
        """The series part of a snapshot reply for a client holding version ``since``:
        ``series_unchanged``, a ``series_delta`` from it (with inserted points if the client
        reads them: ``inserts``), or the whole ``series``."""
        version = self.version(series)
        if since == version:
            return {"series_version": version, "series_unchanged": True}
        with self._lock:
            old = self._recent.get(since) if isinstance(since, str) else None
            cached = self._last_delta
        if old is None:
            return {"series_version": version, "series": dict(series)}
        if cached is not None and cached[:3] == (since, version, inserts):
            return {"series_version": version, "series_delta": cached[3]}
        delta = series_delta(old, series, inserts)
        with self._lock:
            self._last_delta = (since, version, inserts, delta)
        return {"series_version": version, "series_delta": delta}
