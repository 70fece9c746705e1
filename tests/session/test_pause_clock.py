"""Clocks and rates across a pause (issue 29, item 4): the elapsed clock stands still while a
run is paused and goes on from there after it (it never jumps back), the time spent paused is
shown apart, and samples/s counts training time only, in the snapshot (what the dashboard,
the notebook panel and ``ctl status`` show), in a headless run's progress lines and its last
"done:" line, and in ``watch`` of a recorded run."""

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


def test_watch_of_a_recorded_run_takes_its_pauses_out_of_the_elapsed_clock(tmp_path):
    """``workbench watch`` of an ended run rebuilds its clock from events.jsonl: the time
    between each pause and its resume (or the end, for a run stopped while paused) is paused
    time, not training time, as it was in the live run's snapshot."""
    import json

    from workbench.control.watch import RecordedRun, text_summary
    from workbench.core.names import EVENTS_FILE

    records = [("start", 0, 100.0, {"max_steps": 50, "run_name": "r", "pid": 1}), ("log", 10, 110.0, {"loss": 1.0}),
               ("pause", 20, 120.0, {}), ("resume", 20, 150.0, {}),  # 30 s paused
               ("log", 30, 160.0, {"loss": 0.5}), ("pause", 30, 170.0, {}),  # paused until the stop: 30 s more
               ("end", 30, 200.0, {"status": "stopped", "stop_reason": "ctl", "saved": False, "exit_code": 130})]
    (tmp_path / EVENTS_FILE).write_text("".join(
        json.dumps({"event": kind, "time": at, "step": step, **data}) + "\n" for kind, step, at, data in records))
    snap = RecordedRun(tmp_path).snapshot()
    assert snap.paused == 60.0 and snap.elapsed == 40.0  # 100 s from start to end, 60 of them paused
    assert elapsed_text(snap) == "elapsed 0:00:40 (paused 0:01:00)"
    assert text_summary(RecordedRun(tmp_path))[0] == (
        "r: stopped from workbench ctl at step 30/50 after 40s (paused 1m 00s)")


def test_the_headless_done_line_counts_training_time_and_shows_the_pauses_apart():
    """The last line of a headless run: HF's train_runtime is wall time, pauses included; the
    line gives the training time, with the pauses apart, and a rate over training time."""
    from types import SimpleNamespace

    now = [1000.0]
    printer = ProgressCallback(stream=io.StringIO())
    printer.clock = lambda: now[0]  # the Session's pause clock: it stood still during the 90 s paused
    printer.paused = lambda: 90.0
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    printer.on_train_begin(None, state, None)
    now[0] += 30.0
    state.global_step = 100
    logs = {"train_runtime": 120.0, "train_samples_per_second": 10.0, "train_loss": 0.5}
    printer.on_log(None, state, None, logs=logs)
    printer.paused = lambda: 0.5  # under a second of pauses: the wall time, as HF counts it, and no "paused"
    printer.on_log(None, state, None, logs=logs)
    assert printer.stream.getvalue().splitlines() == [
        "done: 100 steps in 0:30 (paused 1:30) | train_loss 0.5000 | 40.0 samples/s",  # 10/s over 120 s is 40/s over 30
        "done: 100 steps in 2:00 | train_loss 0.5000 | 10.0 samples/s"]
