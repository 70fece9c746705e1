"""Clocks and rates across a pause (issue 29, item 4): the elapsed clock stands still while a
run is paused and goes on from there after it (it never jumps back), the time spent paused is
shown apart, and samples/s counts training time only, in the snapshot (what the dashboard,
the notebook panel and ``ctl status`` show) and in a headless run's progress lines."""

from __future__ import annotations

import io
import time

from workbench.door.values import Status
from workbench.session.progress import PauseClock
from workbench.train.callbacks import ProgressCallback
from workbench.widgets.view import elapsed_text, summary_lines

from support import DEADLINE, wait_until
from support.sessions import Slow, make_session


def test_the_pause_clock_stands_still_while_paused():
    clock = PauseClock()
    before = clock.now()
    clock.begin()
    frozen = clock.now()
    time.sleep(0.2)
    assert clock.now() == frozen and clock.paused() >= 0.2
    clock.end()
    assert clock.now() - frozen < 0.05 and clock.total >= 0.2  # goes on from where it stood
    assert clock.now() >= frozen >= before


def test_a_paused_runs_elapsed_time_stands_still_and_its_rate_does_not_decay(tmp_path, sessions):
    session = make_session(tmp_path / "run", callbacks=[Slow(0.01)], max_steps=100_000, save_strategy="no",
                           logging_steps=5, disable_tqdm=False)
    printer = next(cb for cb in session.trainer.callback_handler.callbacks if isinstance(cb, ProgressCallback))
    printer.stream = io.StringIO()
    sessions.append(session.start())
    wait_until(lambda: session.snapshot().step >= 20, "some steps")
    assert session.pause(wait=True, timeout=DEADLINE) == Status.PAUSED
    first = session.snapshot()
    time.sleep(1.6)
    later = session.snapshot()  # a paused run publishes its paused time as it grows
    assert later.elapsed - first.elapsed < 0.1, (first.elapsed, later.elapsed)
    assert later.paused >= 1.0 and later.samples_per_second >= 0.9 * first.samples_per_second
    assert "(paused 0:00:01)" in elapsed_text(later)
    session.resume()
    step = later.step
    wait_until(lambda: session.snapshot().step >= step + 10, "steps after the pause")
    resumed = session.snapshot()
    assert later.elapsed <= resumed.elapsed < later.elapsed + 5  # no jump back, no pause counted in
    assert resumed.paused >= 1.5
    session.stop(save=False)
    session.wait(DEADLINE)
    # The headless progress lines count training time too, with the pause apart.
    lines = [ln for ln in printer.stream.getvalue().splitlines() if ln.startswith("step ")]
    assert any("(paused 0:01)" in ln for ln in lines), lines[-3:]
    assert "stopped from Python (session.stop())" in summary_lines(session.snapshot())[0]
