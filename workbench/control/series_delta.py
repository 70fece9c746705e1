"""Series deltas: what a polling client needs to turn the curves it has into the run's newest.

A run's series are bounded (workbench.session.state.SeriesStore): an evenly thinned history
followed by the most recent points. Between two polls the history usually keeps its points
(and perhaps gains one) and the recent window slides by the few points logged meanwhile,
so the new curve is *a prefix of the old one, then a suffix of the old one, then new
points*. Sending only that (``[prefix_len, suffix_start, new_points]`` per series) keeps a
10 Hz poll at a few hundred bytes however long the run, where the whole curves are ~90 kB
(and ~7 ms of the run's CPU to encode). When the history was thinned again (the rare
halving), or anything else does not fit that shape, the delta carries the whole curve:
``apply_delta(old, series_delta(old, new)) == new`` always holds.
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


def _one(old: Points, new: Points) -> list[Any]:
    """``[a, b, tail]`` with ``new == old[:a] + old[b:] + tail`` (``[0, len(old), new]`` at worst)."""
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
    # Where does new[a] sit in old? Steps grow along a curve, so look it up by step, then check
    # (a curve with a repeated step only gets a longer tail: the check is exact).
    b = bisect.bisect_left(old, new[a][0], lo=a, key=lambda p: p[0])
    kept = len(old) - b
    if b < len(old) and a + kept <= len(new) and old[b:] == new[a:a + kept]:
        return [a, b, list(new[a + kept:])]
    return [a, len(old), list(new[a:])]


def series_delta(old: Mapping[str, Points], new: Mapping[str, Points]) -> dict[str, list[Any]]:
    """Per series of ``new``: ``[a, b, tail]`` such that ``old[name][:a] + old[name][b:] + tail``
    is ``new[name]`` (a series that ``old`` lacks comes whole; one ``new`` lacks is dropped)."""
    return {name: _one(old.get(name, ()), points) for name, points in new.items()}


def apply_delta(old: Mapping[str, tuple], delta: Mapping[str, Sequence[Any]]) -> dict[str, tuple]:
    """The series ``series_delta(old, new)`` describes, rebuilt from ``old`` (ValueError when the
    delta does not fit ``old``: the client then asks for the whole curves)."""
    result: dict[str, tuple] = {}
    for name, (a, b, tail) in delta.items():
        have = old.get(name, ())
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= len(have)):
            raise ValueError(f"series delta for {name!r} does not fit the {len(have)} points held")
        result[name] = (*have[:a], *have[b:], *((int(s), float(v)) for s, v in tail))
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
        self._last_delta: tuple[str, str, dict] | None = None  # pollers at one version share it

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

    def reply(self, series: Mapping[str, Points], since: Any) -> dict[str, Any]:
        """The series part of a snapshot reply for a client holding version ``since``:
        ``series_unchanged``, a ``series_delta`` from it, or the whole ``series``."""
        version = self.version(series)
        if since == version:
            return {"series_version": version, "series_unchanged": True}
        with self._lock:
            old = self._recent.get(since) if isinstance(since, str) else None
            cached = self._last_delta
        if old is None:
            return {"series_version": version, "series": dict(series)}
        if cached is not None and cached[:2] == (since, version):
            return {"series_version": version, "series_delta": cached[2]}
        delta = series_delta(old, series)
        with self._lock:
            self._last_delta = (since, version, delta)
        return {"series_version": version, "series_delta": delta}
