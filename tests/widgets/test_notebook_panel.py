"""The Jupyter panel with real ipywidgets/bqplot objects driving real training runs.

Each test trains for real (the small MLP on synthetic data) in the Session's thread and
presses the panel's buttons with ``Button.click()``, exactly what a click in the browser
triggers in the kernel. Widget messages are captured at ``Widget._send``, the last step
before the comm, so the tests see what a browser would receive. Every wait has a deadline.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("bqplot")

import ipywidgets  # noqa: E402

from workbench import Session, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from workbench.widgets.notebook import Panel  # noqa: E402
from workbench.widgets.notebook.panel import MIN_INTERVAL  # noqa: E402

from support import DEADLINE, Slow, wait_until  # noqa: E402
from support import make_session as _make_session  # noqa: E402


def make_session(out: Path, max_steps: int = 100_000, callbacks=None, **kwargs) -> Session:
    """The shared MLP run, evaluated at the start and every 40 steps and slowed to a few ms a
    step, so a 4 Hz observer sees it move step by step."""
    settings = dict(eval_strategy="steps", eval_steps=40, eval_on_start=True)
    settings.update(kwargs)
    return _make_session(out, callbacks=[Slow(0.004), *(callbacks or [])], max_steps=max_steps, **settings)


class FailAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"boom at step {self.step}")


@pytest.fixture
def run(tmp_path):
    """A started session with its panel; stopped, waited for and closed afterwards."""
    made: list[tuple[Session, Panel]] = []

    def start(**kwargs) -> tuple[Session, Panel]:
        session = make_session(tmp_path / "out", **kwargs)
        panel = session.panel()
        session.start()
        made.append((session, panel))
        return session, panel

    yield start
    for session, panel in made:
        panel.close()
        session.stop(save=False)
        try:
            session.wait(timeout=DEADLINE)
        except Exception:  # noqa: BLE001 - a failing run is some tests' point
            pass


def capture(widget: ipywidgets.Widget) -> list[dict]:
    """Record the state updates ``widget`` sends towards the browser."""
    sent: list[dict] = []
    original = widget._send

    def spy(msg, buffers=None):
        if msg.get("method") == "update":
            state = dict(msg["state"])
            for path, buf in zip(msg.get("buffer_paths", []), buffers or [], strict=True):
                if len(path) == 2 and path[1] == "value":  # bqplot arrays: {"value": buffer, ...}
                    state[path[0]] = np.frombuffer(bytes(buf), dtype=state[path[0]]["dtype"])
            sent.append(state)
        return original(msg, buffers)

    widget._send = spy
    return sent


def steps_of(panel: Panel) -> int:
    return panel.session.snapshot().step


# ------------------------------------------------------------------------------------------- buttons


def test_buttons_pause_resume_and_save_a_real_run(run, tmp_path):
    session, panel = run()
    wait_until(lambda: session.snapshot().step >= 10, "the run to reach step 10")

    panel.pause_button.click()
    wait_until(lambda: session.status == "paused", "Pause to pause the run")
    paused_at = session.snapshot().step
    time.sleep(0.3)
    assert session.snapshot().step == paused_at, "a paused run must not advance"
    wait_until(lambda: panel.pause_button.description == "Resume", "the button to offer Resume")
    assert "PAUSED" in panel.status.value and f"step {paused_at}/" in panel.status.value

    panel.save_button.click()  # paused: saved at once, in this thread
    checkpoint = tmp_path / "out" / f"checkpoint-{paused_at}"
    assert (checkpoint / "manifest.json").is_file()
    assert f"saved checkpoint-{paused_at}" in panel.notice.value
    assert session.snapshot().step == paused_at

    panel.pause_button.click()  # now labelled Resume
    wait_until(lambda: session.snapshot().step > paused_at + 5, "Resume to continue the run")
    assert session.status in ("running", "evaluating", "saving")
    wait_until(lambda: panel.pause_button.description == "Pause", "the button to offer Pause again")

    panel.save_button.click()  # running: saved at the next step end, reported by the observer
    wait_until(lambda: "saved checkpoint-" in panel.notice.value and f"checkpoint-{paused_at}<" not in panel.notice.value,
             "the running save to be reported")
    saved = [c for c in session.checkpoints if c.step > paused_at]
    assert saved and saved[0].complete
    wait_until(lambda: saved[0].name in panel.checkpoints.value, "the checkpoint table to list the save")

    panel.stop_button.click()
    assert session.wait(timeout=DEADLINE) == "stopped"
    wait_until(lambda: panel.stop_button.disabled and panel.pause_button.disabled, "buttons to disable after stop")


def test_evaluate_button_while_paused_and_running(run):
    session, panel = run()
    wait_until(lambda: session.snapshot().step >= 3, "the run to start")
    session.pause(wait=True, timeout=DEADLINE)
    step = session.snapshot().step
    evals_before = len(session.snapshot().series["eval_loss"])
    panel.evaluate_button.click()
    assert "evaluated: loss=" in panel.notice.value
    assert len(session.snapshot().series["eval_loss"]) == evals_before + 1
    assert session.snapshot().step == step
    session.resume()
    panel.evaluate_button.click()
    wait_until(lambda: "evaluated: loss=" in panel.notice.value and len(session.snapshot().series["eval_loss"])
             > evals_before + 1, "the queued evaluation to be reported")


# ---------------------------------------------------------------------------------------------- charts


def test_charts_receive_new_points_incrementally(run):
    session, panel = run(eval_steps=25)
    figure, marks = panel.loss_chart.figure, list(panel.loss_chart.figure.marks)
    loss_line = panel.loss_chart.lines["loss"]
    sent = capture(loss_line)
    lengths: list[int] = []
    loss_line.observe(lambda change: lengths.append(len(change["new"])), names="x")

    wait_until(lambda: len(set(lengths)) >= 4 and session.snapshot().step >= 60, "four chart updates")
    session.pause(wait=True, timeout=DEADLINE)
    time.sleep(2 * MIN_INTERVAL + 0.1)

    # eval_on_start draws the eval loss at step 0, and later evaluations extend that line.
    eval_points = panel.loss_chart.points("eval_loss")
    assert eval_points[0][0] == 0 and len(eval_points) >= 3
    snap = session.snapshot()
    assert panel.loss_chart.points("loss") == [(s, v) for s, v in snap.series["loss"]]
    assert panel.lr_chart.points("learning_rate") == [(s, v) for s, v in snap.series["learning_rate"]]
    assert panel.lr_chart.points("grad_norm") == [(s, v) for s, v in snap.series["grad_norm"]]

    # Incremental: the same figure and marks throughout; each update extends the line
    # (never an empty or shorter array in between); x and y always travel together.
    assert panel.loss_chart.figure is figure and list(figure.marks) == marks
    assert lengths == sorted(lengths) and 0 not in lengths
    assert sent, "the line's points must be sent to the front-end"
    previous = None
    for state in sent:
        assert "x" in state and "y" in state, f"x and y must be sent in one message, got {sorted(state)}"
        x = state["x"]
        assert len(x) == len(state["y"])
        if previous is not None:
            assert len(x) >= len(previous) and np.array_equal(x[:len(previous)], previous)
        previous = x
    assert panel.loss_chart.x_scale.max == snap.max_steps


def test_metrics_memory_tables_mark_the_best(run):
    session, panel = run(eval_steps=20, save_strategy="steps", save_steps=20, metric_for_best_model="loss",
                         load_best_model_at_end=True, max_steps=80)
    assert session.wait(timeout=DEADLINE) == "finished"
    panel.refresh()
    snap = session.snapshot()
    assert snap.best_step is not None
    assert "eval_loss ★" in panel.metrics.value
    assert f"★ best model: step {snap.best_step}" in panel.metrics.value
    assert f"{snap.best_step} ★" in panel.evaluations.value
    assert "params" in panel.memory.value and "host" in panel.memory.value
    best = next(c for c in snap.checkpoints if c.best)
    assert best.name in panel.checkpoints.value and "★ best" in panel.checkpoints.value


def test_error_area_shows_the_failed_runs_exception(run):
    session, panel = run(callbacks=[FailAt(7)])
    with pytest.raises(RuntimeError, match="boom at step 7"):
        session.wait(timeout=DEADLINE)
    wait_until(lambda: panel.error.layout.display != "none", "the error area to appear")
    assert "RuntimeError: boom at step 7" in panel.error.value
    assert "traceback" in panel.error.value and "FailAt" not in panel.status.value
    assert "FAILED" in panel.status.value
    assert panel.pause_button.disabled and panel.save_button.disabled


# ------------------------------------------------------------------------------------------ LR field


def test_lr_field_sets_the_optimizer_lr_and_rejects_bad_input(run):
    session, panel = run()
    wait_until(lambda: session.snapshot().step >= 3, "the run to start")
    session.pause(wait=True, timeout=DEADLINE)
    trainer = session.trainer
    base = list(trainer.lr_scheduler.base_lrs)

    for bad, reason in (("abc", "not a number"), ("", "type a number"), ("-1e-3", "expected a finite number"),
                        ("nan", "expected a finite number"), ("inf", "expected a finite number")):
        panel.lr_field.value = bad
        panel.lr_apply.click()
        assert 'data-level="error"' in panel.notice.value and reason in panel.notice.value, (bad, panel.notice.value)
        assert trainer.lr_scheduler.base_lrs == base, f"{bad!r} must not change the learning rate"

    panel.lr_field.value = "2e-3"  # paused: applied at once
    panel.lr_apply.click()
    groups = trainer.optimizer.param_groups
    assert trainer.lr_scheduler.base_lrs == [2e-3] * len(groups)
    assert all(g["initial_lr"] == 2e-3 for g in groups)
    assert "learning rate set to 2.00e-03" in panel.notice.value and panel.lr_field.value == ""

    session.resume()  # running: applied at the next step end
    panel.lr_field.value = "5e-3"
    panel.lr_apply.click()
    assert "applied at the next step end" in panel.notice.value
    wait_until(lambda: trainer.lr_scheduler.base_lrs == [5e-3] * len(groups), "the queued edit to apply")
    wait_until(lambda: "learning rate set to 5.00e-03" in panel.notice.value, "the edit to be reported")
    # the linear schedule over 100k steps has barely decayed: the current rate follows the new base
    assert all(math.isclose(g["lr"], 5e-3, rel_tol=1e-2) for g in trainer.optimizer.param_groups)
    assert [e["learning_rate"] for e in session.snapshot().edits] == [2e-3, 5e-3]


# ---------------------------------------------------------------------------------------- observer


def test_closing_the_panel_stops_its_observer(run):
    session, panel = run()
    thread = panel._thread
    assert thread is not None and thread.is_alive() and thread.name == "workbench-panel"
    wait_until(lambda: panel.refresh_count >= 3, "a few refreshes")
    ids = [panel.model_id, panel.pause_button.model_id, panel.loss_chart.figure.model_id,
           panel.loss_chart.lines["loss"].model_id]

    panel.close()
    assert not thread.is_alive() and not panel.observing
    assert thread not in threading.enumerate()
    count, step = panel.refresh_count, session.snapshot().step
    wait_until(lambda: session.snapshot().step > step + 20, "training to go on without the panel")
    time.sleep(2 * MIN_INTERVAL)
    assert panel.refresh_count == count, "a closed panel must not refresh"
    with warnings.catch_warnings():  # the registry of live widgets (deprecated name, no public successor)
        warnings.simplefilter("ignore", DeprecationWarning)
        live = ipywidgets.Widget.widgets
    assert all(model_id not in live for model_id in ids)
    with pytest.raises(RuntimeError, match="closed"):
        panel.start()
    assert session.status in ("running", "evaluating"), "closing the panel must not touch the run"


def test_observer_is_throttled_to_4_hz(run):
    session, panel = run()
    wait_until(lambda: session.snapshot().step >= 2, "the run to start")
    before, started = panel.refresh_count, time.monotonic()
    time.sleep(2.0)
    rate = (panel.refresh_count - before) / (time.monotonic() - started)
    assert 0 < rate <= 4.2, rate
    with pytest.raises(ValueError, match="4 times a second"):
        Panel(session, interval=0.1)


def test_observer_and_session_threads_update_widgets_safely(run):
    """Refreshes from several threads at once, while the Session thread logs: no error, one lock."""
    session, panel = run()
    errors: list[BaseException] = []

    def hammer():
        try:
            for _ in range(40):
                panel._last = None
                panel.refresh()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(5):
        panel.pause_button.click()
        time.sleep(0.02)
    for t in threads:
        t.join(DEADLINE)
    assert not errors and panel.observer_error is None
    session.resume()
    wait_until(lambda: session.status in ("running", "evaluating"), "the run to run again")


def test_update_cost_with_a_run_in_progress(run, capsys):
    """Measures ms per full refresh (every widget redrawn) while training; reported, loosely bounded."""
    session, panel = run(eval_steps=20)
    wait_until(lambda: session.snapshot().step >= 40, "some points to draw")
    costs = []
    for _ in range(30):
        panel._last = None
        panel._cache.clear()
        panel.loss_chart._keys.clear()
        panel.lr_chart._keys.clear()
        started = time.perf_counter()
        panel.refresh()
        costs.append(time.perf_counter() - started)
        time.sleep(0.02)
    mean_ms = 1000 * sum(costs) / len(costs)
    with capsys.disabled():
        print(f"\npanel full refresh: {mean_ms:.2f} ms mean, {1000 * max(costs):.2f} ms max "
              f"({len(session.snapshot().series['loss'])} loss points); observer: {panel.refresh_stats}")
    assert mean_ms < 100


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_browser_branches_and_resumes(run, tmp_path):
    session, panel = run(max_steps=60, save_strategy="steps", save_steps=20, eval_steps=20)
    assert panel.branch_button.disabled or session.status != "running"
    assert session.wait(timeout=DEADLINE) == "finished"
    panel.refresh()
    paths = [value for _, value in panel.checkpoint_select.options]
    assert [Path(p).name for p in paths] == ["checkpoint-20", "checkpoint-40", "checkpoint-60"]
    assert not panel.branch_button.disabled and not panel.resume_button.disabled

    panel.checkpoint_select.value = paths[0]
    panel.branch_lr.value = "not-a-rate"
    panel.branch_button.click()
    assert "learning_rate: expected a number" in panel.notice.value and not panel.branches

    panel.branch_lr.value = "3e-3"
    panel.branch_dir.value = str(tmp_path / "branch")
    panel.branch_button.click()
    assert "branched from checkpoint-20" in panel.notice.value
    (branch,) = panel.branches
    (child,) = panel.branch_box.children
    assert isinstance(child, Panel) and child.session is branch
    assert branch.wait(timeout=DEADLINE) == "finished"
    assert branch.trainer.args.learning_rate == 3e-3
    assert branch.snapshot().series["loss"][0][0] > 20, "the branch starts from step 20"
    assert (tmp_path / "branch" / "checkpoint-60" / "manifest.json").is_file()

    panel.checkpoint_select.value = paths[1]
    panel.resume_button.click()
    assert "resuming from checkpoint-40" in panel.notice.value
    assert session.wait(timeout=DEADLINE) == "finished"
    wait_until(lambda: panel.loss_chart.points("loss") and panel.loss_chart.points("loss")[0][0] > 40,
             "the chart to show the resumed run from step 40")
    child_thread = child._thread
    panel.close()
    assert not child_thread.is_alive(), "closing a panel closes its branches' panels too"


def test_a_remote_branch_of_the_panels_run_is_shown_below_it(run, tmp_path):
    """``workbench ctl OUT checkpoints branch`` on a notebook's run: the branch takes the run's
    process over, and the panel shows it below as a branch it made itself."""
    session, panel = run(save_strategy="steps", save_steps=5)
    wait_until(lambda: session.checkpoints, "a checkpoint")
    branch = session.branch_from(session.checkpoints[0].path, tmp_path / "remote-branch", save=False).result(timeout=DEADLINE)
    wait_until(lambda: panel.branches, "the panel to show the branch")
    (shown,) = panel.branches
    (child,) = panel.branch_box.children
    assert shown is branch and child.session is branch
    assert "a branch took over this run" in panel.notice.value and "remote-branch" in panel.notice.value
    panel.refresh()
    assert len(panel.branch_box.children) == 1  # told once
    branch.stop(save=False)
    branch.wait(timeout=DEADLINE)


# ------------------------------------------------------------------------------------------- guard


def test_guard_interventions_are_marked_on_the_loss_chart_and_listed(tmp_path):
    """A real guarded run whose steps 3 (NaN) and 10 (100x loss) are bad: the loss chart gets
    a vertical mark at each step in its kind's colour, and the Guard tab lists both with
    the dataset rows of the step."""
    from workbench import Guard
    from workbench.widgets.view import GUARD_COLORS

    from support.guarded import BATCH, N, Poisoned, Regression, clean_order

    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[2][0]], spike_ids=[steps[9][0]], spike=100.0)
    trainer = Trainer(model=Regression(), train_dataset=data,
                      args=TrainingArguments(str(tmp_path / "run"), max_steps=N // BATCH,
                                             per_device_train_batch_size=BATCH, learning_rate=0.05,
                                             logging_steps=4, save_strategy="no", report_to="none",
                                             disable_tqdm=True, seed=3))
    session = Session(trainer, guard=Guard(nonfinite="skip", spike="skip", spike_factor=20.0, window=4),
                      control=False)
    panel = Panel(session, autostart=False)
    sent = capture(panel.loss_chart.marks)
    try:
        assert panel.loss_chart.marked() == [] and "has not acted" in panel.guard.value
        session.start()
        assert session.wait(timeout=DEADLINE) == "finished"
        panel.refresh()
        assert panel.loss_chart.marked() == [(3, GUARD_COLORS["nonfinite"]), (10, GUARD_COLORS["spike"])]
        assert sent and "x" in sent[-1]  # the marks reached the browser side
        assert panel.tabs.titles[5] == "Guard (2)"
        table = panel.guard.value
        assert table.index(">10<") < table.index(">3<")  # newest first
        for step in (2, 9):
            assert " ".join(str(i) for i in steps[step]) in table
        assert "nan/inf" in table and "spike" in table and "skip" in table
    finally:
        panel.close()
