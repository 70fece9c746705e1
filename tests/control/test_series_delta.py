"""Series deltas (workbench.control.series_delta): a 10 Hz poller gets only what changed in
the run's curves. The rebuilt curves must always equal the run's, through the store's
thinning, new and dropped series, repeated steps and NaNs; and over a real socket a client
gets the whole curves once, then deltas, and a fresh result after every change."""

from __future__ import annotations

import math
import random

import pytest

from workbench.control.client import Connection, attach
from workbench.control.discovery import read_control
from workbench.control.series_delta import SeriesVersions, apply_delta, series_delta
from workbench.door.values import SeriesStore

from support import running, wait_until


def _tuples(series: dict) -> dict:
    return {k: tuple((int(s), float(v)) for s, v in pts) for k, pts in series.items()}


def test_deltas_rebuild_a_real_store_through_thinning_and_new_series():
    rng = random.Random(0)
    store = SeriesStore(limit=40)  # small, so the history is thinned (halved) many times
    held = store.frozen()
    tails = []
    for step in range(3000):
        store.add_log(step, {"loss": rng.random(), "learning_rate": 1e-3})
        if step % 50 == 0:
            store.add_eval(step, {"eval_loss": float("nan") if step == 100 else rng.random()})
        if rng.random() < 0.3:
            new = store.frozen()
            delta = series_delta(held, new)
            assert apply_delta(held, delta) == new, step
            tails.append(max(len(d[2]) for d in delta.values()))
            held = new
    # Most polls send a few points, not the curve (the halvings send more, rarely).
    assert sorted(tails)[len(tails) // 2] <= 5


@pytest.mark.parametrize("inserts", [True, False])
def test_deltas_stay_small_once_the_history_keeps_every_other_point(inserts):
    # Polled every 60 steps (an attached dashboard on a fast run), a store past its first
    # thinnings moves a few aged points into its history each poll, between the kept prefix
    # and the kept recent points: a client that reads inserted points gets those few, not the
    # whole recent window; one that does not (inserts=False) gets the 3-element form only.
    rng = random.Random(1)
    store = SeriesStore(limit=400)
    held, sent, shapes = store.frozen(), [], set()
    for step in range(1, 6001):
        store.add_log(step, {"loss": rng.random(), "grad_norm": rng.random()})
        if step % 60 == 0:
            new = store.frozen()
            delta = series_delta(held, new, inserts)
            assert apply_delta(held, delta) == new, step
            if step > 1000:  # the history keeps every 4th point or fewer by now
                sent.append(max(len(d[2]) + (len(d[3]) if len(d) > 3 else 0) for d in delta.values()))
                shapes.update(len(d) for d in delta.values())
            held = new
    median = sorted(sent)[len(sent) // 2]
    if inserts:
        assert 4 in shapes and median <= 60 + 15  # the new points and the few that aged into the history
    else:
        assert shapes == {3} and median >= 100  # the whole recent window (100 points) and more


def test_deltas_stay_exact_where_the_shape_does_not_fit():
    old = {"loss": ((0, 1.0), (5, 2.0), (5, 3.0), (9, math.nan)), "gone": ((1, 1.0),)}
    cases = [
        {"loss": ((0, 1.0), (5, 3.0), (9, math.nan), (12, 0.5))},  # a repeated step dropped
        {"loss": ((3, 1.0),)},  # nothing in common
        {"loss": old["loss"], "new": ((7, 7.0),)},  # a new series, one dropped
        {"loss": ()},
    ]
    for new in cases:
        rebuilt = apply_delta(old, series_delta(old, new))
        assert {k: [tuple(map(repr, p)) for p in v] for k, v in rebuilt.items()} == \
               {k: [tuple(map(repr, p)) for p in v] for k, v in new.items()}  # repr: NaN == NaN
    with pytest.raises(ValueError, match="does not fit"):
        apply_delta({"loss": ((0, 1.0),)}, {"loss": [0, 5, []]})


def test_versions_name_objects_not_contents():
    versions, other = SeriesVersions(), SeriesVersions()
    a, b = {"loss": ((0, 1.0),)}, {"loss": ((0, 1.0),)}
    assert versions.version(a) == versions.version(a) != versions.version(b)
    assert versions.reply(a, versions.version(a)) == {"series_version": versions.version(a), "series_unchanged": True}
    # Deltas with inserted points go only to a client that reads them (inserts=True).
    c = {"loss": ((0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0))}
    d = {"loss": ((0, 1.0), (2, 3.0), (3, 4.0), (4, 5.0), (5, 6.0))}  # (1, 2.0) gone: prefix, suffix, tail
    e = {"loss": ((0, 1.0), (2, 3.0), (4, 5.0), (5, 6.0))}  # (2, 3.0) kept between prefix and suffix
    since = versions.version(c)
    versions.version(d)
    assert versions.reply(d, since, inserts=True)["series_delta"] == {"loss": [1, 2, [(5, 6.0)]]}
    versions.version(e)
    assert versions.reply(e, since, inserts=True)["series_delta"] == {"loss": [1, 4, [(5, 6.0)], [(2, 3.0)]]}
    assert versions.reply(e, since)["series_delta"] == {"loss": [1, 5, [(2, 3.0), (4, 5.0), (5, 6.0)]]}
    # A version from another run's server never matches: the client gets the whole curves.
    assert other.version(a) != versions.version(a)
    assert versions.reply(a, other.version(a))["series"] == a


def test_a_poller_gets_the_curves_once_then_deltas(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions, logging_steps=1)
    wait_until(lambda: len(session.snapshot().series.get("loss", ())) >= 5, "a few logged losses")
    session.pause(wait=True, timeout=60)
    conn = Connection(read_control(out))
    old_client = conn.call("snapshot")  # sends no series_since: every field, as before
    assert _tuples(old_client["series"]) == session.snapshot().series
    version = old_client["series_version"]
    unchanged = conn.call("snapshot", series_since=version)
    assert unchanged["series_unchanged"] and not unchanged["series"]
    assert _tuples(conn.call("snapshot", series_since="another-run-1")["series"]) == session.snapshot().series

    remote = attach(out)
    first = remote.snapshot()
    assert first.series == session.snapshot().series
    step = session.snapshot().step
    session.resume()
    wait_until(lambda: session.snapshot().step >= step + 20, "more logged steps")
    session.pause(wait=True, timeout=60)
    delta = conn.call("snapshot", series_since=version)
    assert "series_delta" in delta and not delta["series"]
    assert apply_delta(_tuples(old_client["series"]), delta["series_delta"]) == session.snapshot().series
    fresh = remote.snapshot()  # through a delta: the new curves, not the cached ones
    assert fresh.series == session.snapshot().series != first.series
    assert fresh.step == session.snapshot().step
    # A new snapshot with the same curves (an edit while paused): the very same curves object,
    # so a chart skips its redraw.
    session.set(lr_scale=0.5)
    edited = remote.snapshot()
    assert edited is not fresh and edited.edits != fresh.edits
    assert edited.series is fresh.series
    # The thinned curves a chart asks for, from the same run's series.
    thin = remote.series(points=5)
    for name, points in session.snapshot().series.items():
        assert len(thin[name]) == min(5, len(points)) and thin[name][-1] == points[-1]
    remote.close()
    conn.close()
