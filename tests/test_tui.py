"""The terminal dashboard (workbench.widgets.tui), driven like a user drives it.

Pilot tests run the real app (``App.run_test()``) over a real tiny training run (TinyGPT,
one layer, 32-dim embeddings, on the python-source data) in its background thread, press
the real keys and check what the run did. Snapshot tests (pytest-textual-snapshot) render
the main, checkpoints and inspect screens from fixed data, so the pictures do not depend on
timing or on the machine's floating point. The end-to-end test runs ``workbench run`` in a
real terminal (tmux). No timing assertions: every wait is for a condition, with a generous
deadline, because CI machines are shared.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import Session, Trainer, TrainerCallback, TrainingArguments
from workbench.checkpoint.store import CheckpointStore
from workbench.data.builtin import builtin_tokenizer, load_builtin_data
from workbench.config.loader import parse_overrides
from workbench.models import TinyGPT
from workbench.door.values import CheckpointRow, Intervention, MemoryUsage, SessionEvent, Snapshot
from workbench.core.edits import validate_edits
from workbench.widgets.tui import DashboardApp
from workbench.widgets.tui.charts import Chart
from workbench.widgets.tui.checkpoints import CheckpointsScreen
from workbench.widgets.tui.dashboard import CHART_BUDGET, CHART_BUDGET_ATTACHED, CHART_INTERVAL, CHART_INTERVAL_MAX
from workbench.widgets.tui.dialogs import ConfirmDialog, QuitDialog
from workbench.widgets.tui.forms import BranchForm, EditForm
from workbench.widgets.tui.inspect import InspectScreen
from workbench.widgets.view import (
    describe_event,
    downsample,
    fmt_bytes,
    fmt_duration,
    fmt_number,
    memory_rows,
    metric_rows,
    smooth,
)

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 120.0  # seconds; only ever hit when something is broken (or the machine is stuck)


# ----------------------------------------------------------------------------- a real tiny run


_DATA: dict[str, Any] = {}


def _data() -> tuple[Any, Any, Any]:
    if not _DATA:
        train, evals = load_builtin_data("python-source", block_size=32, max_chars=20_000)
        _DATA.update(train=train, evals=evals, tok=builtin_tokenizer("python-source"))
    return _DATA["train"], _DATA["evals"], _DATA["tok"]


class BeginSteps(TrainerCallback):
    """Records the step every train() call starts from (a resume starts from its checkpoint)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def tiny_session(out: Path, **overrides: Any) -> tuple[Session, BeginSteps]:
    """A Session over TinyGPT (1 layer, 32 dims) that would run long enough to steer."""
    train, evals, tok = _data()
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    # Far more steps than any test waits for (an idle machine runs hundreds a second); each
    # test stops the run. Evaluations: eval_on_start only, so the ones a test asks for count.
    options = dict(max_steps=100_000, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                   learning_rate=3e-3, lr_scheduler_type="linear", logging_steps=2, eval_strategy="steps",
                   eval_steps=100_000, eval_on_start=True, save_strategy="no", report_to="none",
                   disable_tqdm=True, seed=1)
    options.update(overrides)
    begins = BeginSteps()
    trainer = Trainer(model=model, args=TrainingArguments(str(out), **options), train_dataset=train,
                      eval_dataset=evals, processing_class=tok, callbacks=[begins])
    return Session(trainer), begins


async def wait_for(pilot, condition, what: str, timeout: float = DEADLINE) -> None:
    """Let the app run until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what} (status {pilot.app.session.status}, step {pilot.app.session.snapshot().step})")
        await pilot.pause(0.05)


async def press(pilot, *keys: str) -> None:
    """Press keys like a user (``App.simulate_key``), without Pilot.press's wait for an idle
    process: with training running in the background the process is never idle, and each
    of Pilot's waits would run into its one-second ceiling."""
    for key in keys:
        pilot.app.simulate_key(key)
        await pilot.pause(0.05)


def drive(session: Session, scenario, size: tuple[int, int] = (100, 32), **app_options: Any) -> DashboardApp:
    """Run ``scenario(app, pilot)`` against a dashboard on ``session``; always stop the run after."""
    app = DashboardApp(session, **app_options)

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: session.status != "idle", "the run to start")
            await scenario(app, pilot)

    try:
        asyncio.run(main())
    finally:
        if session.status not in ("finished", "stopped", "failed", "idle"):
            session.stop(save=False)
        try:
            session.wait(timeout=DEADLINE)
        except Exception:  # noqa: BLE001 - the test's own assertion is what matters
            pass
    return app


def badge(app: DashboardApp) -> str:
    return str(app.dashboard.query_one("#badge").content).strip()


def log_text(app: DashboardApp) -> str:
    return "\n".join(app.dashboard.query_one("#events").history)


# ----------------------------------------------------------------------------- pilot tests: keys


def test_the_readme_guard_capture_comes_from_a_real_guarded_run(tmp_path, monkeypatch):
    """examples/guard_capture.py (the README's picture): the corrupt rows are named by the
    events of the steps that trained on them, and the dashboard lists those steps."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import guard_capture
    finally:
        sys.path.remove(str(ROOT / "examples"))
    monkeypatch.chdir(tmp_path)
    svg = tmp_path / "guard.svg"
    events = guard_capture.capture("runs/guard-demo", svg)
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [
        (10, "spike", "rollback"), (18, "nonfinite", "skip"), (110, "spike", "rollback"),
        (103, "nonfinite", "skip"), (117, "spike", "rollback")]
    for event in events:
        bad_row = guard_capture.SPIKE_ROW if event["kind"] == "spike" else guard_capture.NAN_ROW
        assert bad_row in event["samples"]
        if event["action"] == "rollback":
            assert set(event["samples"]) <= set(event["skipped_samples"])
    picture = svg.read_text(encoding="utf-8").replace("&#160;", " ")
    assert "rollback→110 (skip 72)" in picture and "nan/inf" in picture
    assert "files in runs/guard-demo" in picture  # the output_dir the README's capture shows



def test_a_guarded_nan_is_marked_on_the_loss_chart_and_listed(tmp_path):
    """A real guarded run whose step 3 trains on a NaN row: the dashboard draws a line at
    step 3 on the loss chart, lists the step with its rows, and logs it."""
    from test_guard import BATCH, N, Poisoned, Regression, clean_order

    from workbench import Guard
    from workbench.widgets.tui.panels import GuardTable

    steps = clean_order(tmp_path)
    trainer = Trainer(model=Regression(), train_dataset=Poisoned(nan_ids=[steps[2][0]]),
                      args=TrainingArguments(str(tmp_path / "run"), max_steps=N // BATCH,
                                             per_device_train_batch_size=BATCH, learning_rate=0.05,
                                             logging_steps=2, save_strategy="no", report_to="none",
                                             disable_tqdm=True, seed=3))
    session = Session(trainer, guard=Guard(nonfinite="skip"), control=False)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.status == "finished", "the run to finish")
        chart = app.dashboard.query_one("#loss-chart")
        await wait_for(pilot, lambda: chart.plotted.get("interventions"), "the mark on the loss chart")
        assert [s for s, _ in chart.plotted["interventions"]] == [3]
        table = app.dashboard.query_one(GuardTable)
        assert table.display and [(i.step, i.kind, i.action) for i in table.items] == [(3, "nonfinite", "skip")]
        text = str(table.render())
        assert "nan/inf" in text and " ".join(str(i) for i in steps[2]) in text
        await wait_for(pilot, lambda: "guard nan/inf" in log_text(app), "the guard line in the event log")

    drive(session, scenario)



def test_space_pauses_the_step_counter_shows_paused_and_resumes(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "space")
        await wait_for(pilot, lambda: session.status == "paused", "the pause")
        await wait_for(pilot, lambda: badge(app) == "PAUSED", "the PAUSED badge")
        step = session.snapshot().step
        await pilot.pause(0.5)
        assert session.snapshot().step == step, "the step counter moved while paused"
        assert "paused" in log_text(app)
        progress = str(app.dashboard.query_one("#progress-line").content)
        assert f"step {step}/100000" in progress

        await press(pilot, "p")  # p is the other pause/resume key
        await wait_for(pilot, lambda: session.snapshot().step > step, "steps after resuming")
        await wait_for(pilot, lambda: badge(app) == "RUNNING", "the RUNNING badge")
        # The event log is fed by the bridge's own thread: the line may follow the badge.
        await wait_for(pilot, lambda: "resumed" in log_text(app), "the resumed line in the event log")

    drive(session, scenario)


def test_s_saves_a_checkpoint_that_appears_in_the_catalog(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 1, "a first step")
        assert session.checkpoints == []
        await press(pilot, "s")  # while running: saved at the next step end
        await wait_for(pilot, lambda: len(session.checkpoints) == 1, "the first save")
        # Pause past the first checkpoint's step, or the paused save re-saves that step.
        first = session.checkpoints[0].step
        await wait_for(pilot, lambda: session.snapshot().step > first, "a step past the first save")
        await press(pilot, "space")
        await wait_for(pilot, lambda: session.status == "paused", "the pause")
        await press(pilot, "s")  # while paused: saved at once, in a worker thread
        await wait_for(pilot, lambda: len(session.checkpoints) == 2, "the second save")
        await wait_for(pilot, lambda: log_text(app).count("saved checkpoint-") == 2, "two saves in the log")

        await press(pilot, "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CheckpointsScreen) and app.screen.rows,
                       "the checkpoints screen")
        table = app.screen.query_one("#ckpt-table")
        assert table.row_count == 2
        names = [c.name for c in session.checkpoints]
        assert [str(k.value) for k in table.rows] == names
        assert all(CheckpointStore(tmp_path / "run").verify(c.path)[0] for c in session.checkpoints)

    drive(session, scenario)


def test_e_evaluates_and_adds_a_point_to_the_loss_chart(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        chart = app.dashboard.query_one("#loss-chart")
        # eval_on_start: the first point is at step 0
        await wait_for(pilot, lambda: len(chart.plotted.get("eval_loss", [])) == 1, "the eval_on_start point")
        assert chart.plotted["eval_loss"][0][0] == 0
        await press(pilot, "e")
        await wait_for(pilot, lambda: len(chart.plotted.get("eval_loss", [])) == 2, "the second eval point")
        assert chart.plotted["eval_loss"][1][0] > 0
        assert log_text(app).count("eval_loss=") == 2

        await press(pilot, "space")  # and while paused: evaluated at once, off the UI thread
        await wait_for(pilot, lambda: session.status == "paused", "the pause")
        await press(pilot, "e")
        await wait_for(pilot, lambda: len(chart.plotted.get("eval_loss", [])) == 3, "the paused eval point")

    drive(session, scenario)


@pytest.mark.parametrize("attached", [False, True])
def test_chart_redraws_are_spaced_by_what_the_draws_cost(tmp_path, attached):
    # A dashboard must stay light on a loaded machine: slow chart builds are spaced further
    # apart, so the charts use at most CHART_BUDGET of a core (an attached one, a process of
    # its own, CHART_BUDGET_ATTACHED).
    session, _ = tiny_session(tmp_path / "run")
    budget = CHART_BUDGET_ATTACHED if attached else CHART_BUDGET

    async def scenario(app, pilot):
        charts = list(app.dashboard.query(Chart))
        assert len(charts) == 2
        await wait_for(pilot, lambda: all(c.build_seconds > 0 for c in charts), "each chart's first build, timed")
        for cost, interval in ((0.0, CHART_INTERVAL), (0.05, 0.1 / budget), (1.0, CHART_INTERVAL_MAX)):
            for chart in charts:
                chart.build_seconds = cost
            assert app.dashboard.chart_interval() == pytest.approx(interval)

    drive(session, scenario, attached=attached)


def test_edit_form_refuses_bad_input_and_changes_the_optimizers_lr(tmp_path):
    session, _ = tiny_session(tmp_path / "run")
    optimizer = lambda: getattr(session.trainer.optimizer, "optimizer", session.trainer.optimizer)  # noqa: E731

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "l")
        await wait_for(pilot, lambda: isinstance(app.screen, EditForm), "the edit form")
        form = app.screen
        # Pushed is not yet composed on a loaded machine: wait for the fields themselves.
        await wait_for(pilot, lambda: bool(form.query("#edit-learning_rate")), "the form's fields")
        error = lambda: str(form.query_one(".form-error").content)  # noqa: E731

        form.query_one("#edit-learning_rate").value = "fast"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "is not a number" in error(), "the refusal")
        assert app.screen is form, "a refused edit must keep the form open"

        form.query_one("#edit-learning_rate").value = ""
        form.query_one("#edit-max_steps").value = "1"  # below the current step
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "below the current step" in error(), "the max_steps refusal")
        form.query_one("#edit-max_steps").value = ""
        form.query_one("#edit-eval_steps").value = "-5"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "positive whole number" in error(), "the eval_steps refusal")
        form.query_one("#edit-eval_steps").value = ""
        assert not session.snapshot().edits, "refused input reached the session"

        form.query_one("#edit-learning_rate").value = "1e-4"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: app.screen is not form, "the form to close")
        await wait_for(pilot, lambda: set(session.trainer.lr_scheduler.base_lrs) == {1e-4}, "the edit to land")
        # The optimizer's own groups follow: the base rate and the current (scheduled) rate.
        step = session.snapshot().step
        await wait_for(pilot, lambda: session.snapshot().step > step + 1, "a step with the new rate")
        for group in optimizer().param_groups:  # every group (decay and no-decay)
            assert group["initial_lr"] == 1e-4
            assert 0 < group["lr"] <= 1e-4
        await wait_for(pilot, lambda: "set learning_rate=0.0001" in log_text(app), "the edit in the log")

    drive(session, scenario)


def test_checkpoints_screen_resumes_from_the_chosen_checkpoint(tmp_path):
    session, begins = tiny_session(tmp_path / "run", save_strategy="steps", save_steps=10)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: len(session.checkpoints) >= 3, "three checkpoints")
        await press(pilot, "space")
        await wait_for(pilot, lambda: session.status == "paused", "the pause")
        paused_at = session.snapshot().step
        await press(pilot, "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CheckpointsScreen) and app.screen.rows,
                       "the checkpoints screen")
        screen = app.screen
        table = screen.query_one("#ckpt-table")
        assert table.cursor_row == table.row_count - 1, "the newest checkpoint is selected first"
        await press(pilot, "home")  # the oldest: checkpoint-10
        assert screen.selected.name == "checkpoint-10"
        detail = str(screen.query_one("#ckpt-detail").content)
        assert "checkpoint-10" in detail and "config vs current run" in detail

        await press(pilot, "r")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog) and app.screen.focused, "the confirmation")
        await press(pilot, "enter")  # the confirmation's default is "Resume"
        await wait_for(pilot, lambda: begins.steps == [0, 10], "a train() that starts at step 10")
        await wait_for(pilot, lambda: session.status == "running" and app.screen is app.dashboard,
                       "the dashboard on the resumed run")
        assert paused_at > 10
        await wait_for(pilot, lambda: "resumed from checkpoint-10" in log_text(app), "the resume in the log")

    drive(session, scenario)


def test_checkpoints_screen_protects_the_newest_and_deletes_others(tmp_path):
    session, _ = tiny_session(tmp_path / "run", save_strategy="steps", save_steps=5)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: len(session.checkpoints) >= 2, "two checkpoints")
        await press(pilot, "space")
        await wait_for(pilot, lambda: session.status == "paused", "the pause")
        await press(pilot, "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CheckpointsScreen) and app.screen.rows,
                       "the checkpoints screen")
        screen = app.screen
        newest = screen.selected.name
        await press(pilot, "d")  # the newest is protected: refused, nothing asked
        assert newest in [c.name for c in session.checkpoints]
        assert app.screen is screen
        await press(pilot, "home")
        # Keys are handled asynchronously: wait for each one's effect (a loaded machine may
        # take longer than press()'s pause).
        await wait_for(pilot, lambda: screen.selected.name == screen.rows[0].name, "the cursor on the first row")
        oldest = screen.selected.name
        await press(pilot, "d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog) and app.screen.focused, "the confirmation")
        await press(pilot, "enter")  # the confirmation's focus is on "No"
        await wait_for(pilot, lambda: app.screen is screen, "the confirmation to close")
        assert oldest in [c.name for c in session.checkpoints]
        await press(pilot, "d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog) and app.screen.focused, "the confirmation")
        await press(pilot, "left")
        await wait_for(pilot, lambda: app.screen.focused.id == "confirm-yes", "the focus on Delete")
        await press(pilot, "enter")  # "Delete"
        await wait_for(pilot, lambda: oldest not in [c.name for c in session.checkpoints], "the delete")
        assert screen.query_one("#ckpt-table").row_count == len(session.checkpoints)

    drive(session, scenario)


def test_branch_form_checks_overrides_and_follows_the_new_run(tmp_path):
    session, _ = tiny_session(tmp_path / "run", save_strategy="steps", save_steps=5)
    branch_dir = tmp_path / "branch"

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: len(session.checkpoints) >= 1, "a checkpoint")
        await press(pilot, "space")
        await wait_for(pilot, lambda: session.status == "paused", "the pause")
        await press(pilot, "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CheckpointsScreen) and app.screen.rows,
                       "the checkpoints screen")
        await press(pilot, "home", "b")
        await wait_for(pilot, lambda: isinstance(app.screen, BranchForm), "the branch form")
        form = app.screen
        error = lambda: str(form.query_one(".form-error").content)  # noqa: E731
        form.query_one("#branch-output_dir").value = str(tmp_path / "run")  # the parent's own folder
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "is this run's own output_dir" in error(), "the parent-folder refusal")
        form.query_one("#branch-output_dir").value = str(branch_dir)
        form.query_one("#branch-other").value = "no_such_argument=1"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "no_such_argument: unknown key" in error(), "the refusal")
        form.query_one("#branch-other").value = ""
        form.query_one("#branch-learning_rate").value = "1e-3"
        form.query_one("#branch-output_dir").focus()
        await press(pilot, "enter")
        await wait_for(pilot, lambda: app.session is not session and app.session.status == "running",
                       "the dashboard following the branch")
        assert session.status == "stopped"
        assert app.session.args.learning_rate == 1e-3
        assert Path(app.session.args.output_dir) == branch_dir
        await wait_for(pilot, lambda: app.session.snapshot().step > 5, "the branch training")
        assert "branched from checkpoint-5" in log_text(app)

    app = drive(session, scenario)
    branch = app.session
    branch.stop(save=False)
    branch.wait(timeout=DEADLINE)


def test_the_dashboard_follows_a_branch_that_takes_its_run_over_and_quits_from_it(tmp_path):
    """A remote ``checkpoints branch`` (what the endpoint's server calls) stops the run the
    dashboard shows and starts the branch in its process: the dashboard follows it, and
    q then Enter stops and saves the branch."""
    session, _ = tiny_session(tmp_path / "run", save_strategy="steps", save_steps=5)
    branch_dir = tmp_path / "remote-branch"
    holder: dict[str, Any] = {}

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: len(session.checkpoints) >= 1, "a checkpoint")
        holder["branch"] = session.branch_from(session.checkpoints[0].path, branch_dir, save=False)
        await wait_for(pilot, lambda: holder["branch"].done() and app.session is holder["branch"].result(),
                       "the dashboard following the branch")
        branch = app.session
        assert session.status == "stopped"
        await wait_for(pilot, lambda: "a branch took over this run" in log_text(app), "the note")
        await wait_for(pilot, lambda: app.session.snapshot().step > 5, "the branch training")
        assert log_text(app).count("a branch took over this run") == 1  # told once
        await press(pilot, "q")
        await wait_for(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the quit dialog")
        await press(pilot, "enter")
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")
        holder["branch"] = branch

    app = drive(session, scenario)
    assert app.return_value == "saved" and holder["branch"].status == "stopped"
    assert any(branch_dir.glob("checkpoint-*")), "the quit saved the branch"


def test_quit_q_then_enter_stops_saves_and_exits(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "q")
        await wait_for(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the quit dialog")
        assert app.screen.focused.id == "quit-save"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

    app = drive(session, scenario)
    assert app.return_value == "saved"
    assert session.status == "stopped"
    step = session.snapshot().step
    assert [c.name for c in session.checkpoints] == [f"checkpoint-{step}"]
    assert CheckpointStore(tmp_path / "run").verify(session.checkpoints[0].path) == (True, None)


def test_quit_escape_cancels_and_the_run_goes_on(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "q")
        await wait_for(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the quit dialog")
        await press(pilot, "escape")
        await wait_for(pilot, lambda: app.screen is app.dashboard, "the dialog to close")
        step = session.snapshot().step
        await wait_for(pilot, lambda: session.snapshot().step > step, "more steps")
        assert app.return_value is None
        assert session.status == "running"

    drive(session, scenario)
    assert session.checkpoints == []


def test_quit_stop_without_saving_exits_130_and_saves_nothing(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "q")
        await wait_for(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the quit dialog")
        await press(pilot, "right")  # focus: "Stop without saving"
        await wait_for(pilot, lambda: app.screen.focused.id == "quit-discard", "the focus on Stop without saving")
        await press(pilot, "enter")
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

    from workbench.widgets.tui import OUTCOMES

    app = drive(session, scenario)
    from workbench.core.exit_codes import OUTCOME_CODES

    assert app.return_value == "stopped" and OUTCOME_CODES["stopped"] == 130
    assert set(OUTCOMES) == set(OUTCOME_CODES)  # every outcome the app returns has its code
    assert session.status == "stopped"
    assert session.checkpoints == []


def test_a_finished_run_keeps_its_summary_and_quits_at_once(tmp_path):
    session, _ = tiny_session(tmp_path / "run", max_steps=6, save_strategy="steps", save_steps=6)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.status == "finished", "the end of the run")
        await wait_for(pilot, lambda: app.dashboard.query_one("#summary").display, "the summary")
        summary = str(app.dashboard.query_one("#summary").content)
        assert "finished at step 6/6" in summary and "checkpoint-6" in summary
        assert str(tmp_path / "run") in summary
        await pilot.pause(0.3)
        assert app.return_value is None, "the summary must stay until the user quits"
        await press(pilot, "q")  # no dialog: the run is over
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

    app = drive(session, scenario)
    assert app.return_value == "finished"


def test_inspect_pauses_and_shows_norms_and_a_sample(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "i")
        await wait_for(pilot, lambda: isinstance(app.screen, InspectScreen), "the inspect screen")
        screen = app.screen
        await wait_for(pilot, lambda: screen.report is not None, "the inspection")
        assert session.status == "paused"
        expected = session.inspect()
        table = screen.query_one("#layers")
        assert table.row_count == len(expected["layers"]) == len(list(session.model.parameters()))
        first = expected["layers"][0]
        cells = [str(c) for c in table.get_row_at(0)]
        assert cells[0] == first["name"]
        assert cells[2] == fmt_number(first["param_norm"])
        assert math.isfinite(first["param_norm"]) and first["param_norm"] > 0
        summary = str(screen.query_one("#inspect-summary").content)
        assert "learning rates:" in summary and "input_ids (8, 32)" in summary and "no NaN/Inf" in summary

        prompt = screen.query_one("#prompt")
        assert prompt.display  # a causal LM: the prompt box is offered, and takes the focus
        await wait_for(pilot, lambda: prompt.has_focus, "the prompt box to take the focus")
        prompt.value = "def "
        await press(pilot, "enter")
        sample = screen.query_one("#sample")
        await wait_for(pilot, lambda: len(str(sample.content)) > len("def ") and "sampling" not in str(sample.content),
                       "the sample")
        assert str(sample.content).startswith("def ")
        assert str(sample.content) == "def " + session.sample("def ", max_new_tokens=80)
        await press(pilot, "escape")
        assert app.screen is app.dashboard and session.status == "paused"

    drive(session, scenario)


def test_help_lists_every_key(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await press(pilot, "question_mark")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "HelpScreen", "the help screen")
        from workbench.widgets.tui.help import HELP_TEXT

        for key in ("space / p", "s ", "e ", "l ", "c ", "i ", "q ", "r / enter", "b ", "d / delete"):
            assert f"\n  {key}" in HELP_TEXT
        await press(pilot, "escape")
        await wait_for(pilot, lambda: app.screen is app.dashboard, "the help screen to close")
        footer_keys = {b.key for b in app.dashboard.BINDINGS}
        assert {"space,p", "s", "e", "c", "i", "l", "q", "question_mark"} <= footer_keys

    drive(session, scenario)


def test_warnings_from_the_core_go_to_the_event_log(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        import logging

        logging.getLogger("workbench").warning("disk almost full\nsecond line")
        await wait_for(pilot, lambda: "disk almost full" in log_text(app), "the warning in the log")
        assert "second line" not in log_text(app)
        # The warnings HF's Trainer gives come out on transformers' loggers: shown here too.
        logging.getLogger("transformers.trainer").warning("Checkpoint included callbacks not included")
        await wait_for(pilot, lambda: "Checkpoint included callbacks" in log_text(app), "HF's warning in the log")

    drive(session, scenario)
    import logging

    assert logging.getLogger("workbench").propagate, "the app must restore the logger when it exits"


# ----------------------------------------------------------------------------- snapshot tests


NOW = 1_700_000_000.0


def _series() -> dict[str, tuple]:
    loss = tuple((s, 4.2 * math.exp(-s / 90) + 1.3 + 0.08 * math.sin(s / 3)) for s in range(2, 302, 2))
    lr = tuple((s, 3e-3 * min(1.0, s / 30) * (1 - s / 400)) for s in range(2, 302, 2))
    grad = tuple((s, 1.2 + 0.6 * math.exp(-s / 60) + 0.1 * math.cos(s / 5)) for s in range(2, 302, 2))
    evals = ((0, 4.61), (100, 2.35), (200, 1.92), (300, 1.81))
    acc = ((0, 0.04), (100, 0.31), (200, 0.42), (300, 0.44))
    return {"loss": loss, "learning_rate": lr, "grad_norm": grad, "eval_loss": evals, "eval_accuracy": acc}


def _write_checkpoint(root: Path, step: int, eval_loss: float, best: str, args: dict, edits: list) -> None:
    """A checkpoint folder with the small files the catalog reads (fixed bytes, fixed times)."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    state = {"global_step": step, "epoch": step / 75, "best_model_checkpoint": str(root / best),
             "log_history": [{"eval_loss": eval_loss, "eval_runtime": 0.5, "step": step}], "live_edits": edits}
    (path / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    (path / "training_args.json").write_text(json.dumps(args), encoding="utf-8")
    files = {"model.safetensors": {"size": 271_000 + step, "sha256": "0"},
             "optimizer.pt": {"size": 545_000, "sha256": "0"}}
    manifest = {"format": 1, "step": step, "created": NOW - 3600 + step * 6, "files": files}
    (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


class FixedSession:
    """A finished or paused run frozen in time: the Session's read API over fixed data.

    Only the snapshot tests use it: they need pixels that do not depend on timing or on the
    machine's floating point. The behaviour of the real Session is covered by the Pilot
    tests above.
    """

    successor = None

    def __init__(self, root: Path, status: str, interventions: tuple = ()) -> None:
        self.status = status
        self.stop_reason = None
        self.args = TrainingArguments(str(root), learning_rate=1e-3, max_steps=300, eval_strategy="steps",
                                      eval_steps=100, save_steps=100, metric_for_best_model="eval_loss",
                                      run_name="tiny-gpt", report_to="none")
        saved = json.loads(self.args.to_json_string())
        saved_old = dict(saved, learning_rate=3e-3)
        _write_checkpoint(root, 100, 2.35, "checkpoint-200", saved_old, [])
        _write_checkpoint(root, 200, 1.92, "checkpoint-200", saved_old, [])
        _write_checkpoint(root, 300, 1.81, "checkpoint-200", saved,
                          [{"step": 250, "time": NOW, "learning_rate": 1e-3}])
        self.memory_report = MemoryUsage(parameters=271_104, gradients=271_104, optimizer_state=542_720,
                                          device_type="cpu", device_allocated=None, device_reserved=None,
                                          device_peak=None, host_rss=612_000_000, host_peak=650_000_000)
        step = 300 if status == "finished" else 250
        series = {k: tuple(p for p in v if p[0] <= step) for k, v in _series().items()}
        self._snapshot = Snapshot(
            status=status, step=step, max_steps=300, epoch=step / 75, elapsed=95.0, steps_per_second=3.2,
            samples_per_second=51.2, tokens_per_second=6553.6, eta=None if status == "finished" else 15.6,
            series=series, best_metric=1.92, best_step=200, memory=self.memory_report,
            checkpoints=tuple(CheckpointRow.from_dict(c.to_dict()) for c in CheckpointStore(root).list()
                              if c.step <= step),
            edits=({"step": 250, "time": NOW, "learning_rate": 1e-3},), run_name="tiny-gpt",
            interventions=interventions, guard_interventions=len(interventions),
            output_dir="runs/tiny-gpt", device="cpu", updated=NOW)
        self.events: list[SessionEvent] = []
        for kind, at, data in [("started", 0, {"max_steps": 300}), ("evaluated", 0, {"eval_loss": 4.61}),
                               ("evaluated", 100, {"eval_loss": 2.35, "eval_accuracy": 0.31}),
                               ("saved", 100, {"checkpoint": str(root / "checkpoint-100")}),
                               ("evaluated", 200, {"eval_loss": 1.92, "eval_accuracy": 0.42}),
                               ("saved", 200, {"checkpoint": str(root / "checkpoint-200")}),
                               ("paused", 250, {}), ("edited", 250, {"learning_rate": 1e-3})]:
            self.events.append(SessionEvent(kind, at, NOW, data))

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        return self.events[cursor:], len(self.events)

    def arguments(self) -> dict[str, Any]:
        return json.loads(self.args.to_json_string())

    @property
    def checkpoints(self) -> list:
        return list(self._snapshot.checkpoints)

    def inspect(self) -> dict[str, Any]:
        layers = []
        for i, (name, shape) in enumerate([("wte.weight", (99, 32)), ("wpe.weight", (32, 32)),
                                           ("blocks.0.attn.qkv.weight", (96, 32)), ("blocks.0.mlp.fc.weight", (128, 32)),
                                           ("ln_f.weight", (32,)), ("head.weight", (99, 32))]):
            layers.append({"name": name, "shape": shape, "param_norm": 1.5 + i * 0.75, "grad_norm": 0.05 * (i + 1),
                           "update_ratio": 1e-3 * (i + 1), "nan": 0, "inf": 0, "trainable": True})
        return {"step": 250, "layers": layers, "learning_rates": [1e-3],
                "batch_shapes": {"input_ids": (8, 32), "labels": (8, 32)},
                "can_sample": False}  # no prompt box in the picture

    def memory(self) -> MemoryUsage:
        return self.memory_report


def fixed_app(tmp_path: Path, status: str, interventions: tuple = ()) -> DashboardApp:
    return DashboardApp(FixedSession(tmp_path / "runs" / "tiny-gpt", status, interventions), autostart=False,
                        frozen=True)


GUARDED = (
    Intervention(step=64, kind="nonfinite", action="skip", value="nan", threshold=2.41, samples=(17, 902, 311, 45)),
    Intervention(step=150, kind="spike", action="rollback", value=412.5, threshold=5.2, samples=(7, 88, 630, 1021),
                 restored_step=100, skipped_samples=208),
    Intervention(step=230, kind="spike", action="skip", value=61.0, threshold=4.4,
                 samples=(3, 14, 159, 265, 358, 979, 323, 846)),
)


async def _events_shown(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.dashboard.query("#events"), "the dashboard")
    await wait_for(pilot, lambda: len(log_text(app).splitlines()) >= 8, "the fixed events")
    await wait_for(pilot, lambda: app.dashboard.query_one("#loss-chart").plotted.get("eval_loss"), "the charts")
    # The layout after the status switch (summary or progress line) is redone after a
    # refresh: on a loaded machine a fixed pause could take the picture before it.
    from workbench.widgets.tui.panels import ProgressPanel, SummaryPanel

    panel = SummaryPanel if app.session.status in ("finished", "stopped", "failed") else ProgressPanel
    await wait_for(pilot, lambda: app.dashboard.query_one(panel).region.height > 0, "the layout for the status")
    await pilot.pause(0.1)


def test_an_ended_runs_snapshot_is_shown_again_until_every_panel_took_it(tmp_path, monkeypatch):
    """An ended run's snapshot never changes: a first show that meets a panel not composed
    yet (NoMatches, seen on a loaded machine) is retried, not left half shown."""
    from textual.css.query import NoMatches

    from workbench.widgets.tui.dashboard import DashboardScreen
    from workbench.widgets.tui.panels import SummaryPanel

    real, failed = DashboardScreen._show, []

    def first_show_meets_an_uncomposed_panel(self, snapshot, frozen):
        if not failed:
            failed.append(True)
            raise NoMatches("SummaryPanel")
        return real(self, snapshot, frozen)

    monkeypatch.setattr(DashboardScreen, "_show", first_show_meets_an_uncomposed_panel)
    app = fixed_app(tmp_path, "finished")

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            summary = app.dashboard.query_one(SummaryPanel)
            await wait_for(pilot, lambda: "finished at step 300/300" in str(summary.render()), "the summary")

    asyncio.run(main())
    assert failed


def test_snapshot_main_screen_finished_80x24(tmp_path, snap_compare):
    assert snap_compare(fixed_app(tmp_path, "finished"), terminal_size=(80, 24), run_before=_events_shown)


def test_snapshot_main_screen_paused_large(tmp_path, snap_compare):
    assert snap_compare(fixed_app(tmp_path, "paused"), terminal_size=(130, 40), run_before=_events_shown)


def test_snapshot_main_screen_with_guard_interventions(tmp_path, snap_compare):
    async def guard_shown(pilot):
        await _events_shown(pilot)
        await wait_for(pilot, lambda: pilot.app.dashboard.query_one("#loss-chart").plotted.get("interventions"),
                       "the guard marks")
        await pilot.pause(0.1)

    assert snap_compare(fixed_app(tmp_path, "finished", GUARDED), terminal_size=(110, 32), run_before=guard_shown)


def test_snapshot_checkpoints_screen(tmp_path, snap_compare):
    async def open_checkpoints(pilot):
        await _events_shown(pilot)
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, CheckpointsScreen), "the checkpoints screen")
        await pilot.press("up")  # checkpoint-200: the best, with a config difference
        await pilot.pause(0.1)

    assert snap_compare(fixed_app(tmp_path, "finished"), terminal_size=(110, 30), run_before=open_checkpoints)


def test_snapshot_inspect_screen(tmp_path, snap_compare):
    async def open_inspect(pilot):
        await _events_shown(pilot)
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, InspectScreen) and pilot.app.screen.report,
                       "the inspection")
        await pilot.pause(0.1)

    assert snap_compare(fixed_app(tmp_path, "paused"), terminal_size=(110, 30), run_before=open_inspect)


# ----------------------------------------------------------------------------- pure pieces


def test_downsample_keeps_spikes_and_the_ends():
    points = [(s, 1.0) for s in range(10_000)]
    points[5_003] = (5_003, 50.0)
    out = downsample(points, 100)
    assert len(out) <= 104
    assert (5_003, 50.0) in out
    assert out[0] == points[0] and out[-1] == points[-1]
    assert [p[0] for p in out] == sorted(p[0] for p in out)
    assert downsample(points[:10], 100) == points[:10]


def test_smooth_is_debiased_and_keeps_non_finite_values_visible():
    points = [(1, 2.0), (2, 2.0), (3, float("nan")), (4, 2.0)]
    out = smooth(points, weight=0.9)
    assert out[0] == (1, pytest.approx(2.0)) and out[1][1] == pytest.approx(2.0)
    assert math.isnan(out[2][1])


def test_formatting():
    assert fmt_number(None) == "-" and fmt_number(float("nan")) == "nan" and fmt_number(2.345678) == "2.346"
    assert fmt_duration(5) == "5s" and fmt_duration(184) == "3m 04s" and fmt_duration(3720) == "1h 02m"
    assert fmt_duration(None) == "-"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.5 KB" and fmt_bytes(3 * 1024**3) == "3.0 GB"


def test_metric_rows_mark_the_metric_that_picks_the_best_checkpoint():
    series = _series()
    rows = {r.name: r for r in metric_rows(series, best_metric=1.92, best_step=200)}
    assert list(rows)[0] == "eval_loss"
    assert rows["eval_loss"].selects_best and rows["eval_loss"].best == 1.92 and rows["eval_loss"].best_step == 200
    assert rows["eval_loss"].latest == 1.81
    assert not rows["eval_accuracy"].selects_best and rows["eval_accuracy"].best == 0.44  # higher is better
    assert "loss" in rows and "learning_rate" not in rows


def test_memory_rows_and_events_read_plainly():
    report = MemoryUsage(100, 100, 200, "cuda", 1000, 2000, 1500, 10, 20)
    rows = {r.label: r for r in memory_rows(report)}
    assert rows["params"].scale == 400 and rows["activ."].value == 1100 and rows["cuda"].peak == 1500
    assert describe_event("logged", 3, {"loss": 1.0}) is None
    assert describe_event("logged", 3, {"loss": float("nan")})[0] == "warn"
    assert describe_event("saved", 7, {"checkpoint": "/x/checkpoint-7"}) == ("good", "step 7: saved checkpoint-7")


def test_the_forms_text_is_read_by_the_session_layer():
    # What the edit and branch forms send (text as typed) and how the session layer reads it.
    assert validate_edits({"learning_rate": "1e-4", "eval_steps": "50"}, 10) == {"learning_rate": 1e-4, "eval_steps": 50}
    for texts, message in [({"learning_rate": "x"}, "not a number"), ({"max_steps": "2.5"}, "whole number"),
                           ({"max_steps": "5"}, "below the current step"), ({}, "nothing to change"),
                           ({"learning_rate": "1e-3", "lr_scale": "2"}, "not both"),
                           ({"lr_scale": "0"}, "positive")]:
        with pytest.raises(ValueError, match=message):
            validate_edits(texts, 10)
    assert parse_overrides("warmup_steps=10, training.lr_scheduler_type=linear") == {
        "warmup_steps": 10, "lr_scheduler_type": "linear"}
    assert parse_overrides({"learning_rate": "1e-3", "max_steps": ""}) == {"learning_rate": 1e-3}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides("oops")


# ----------------------------------------------------------------------------- a real terminal


def _capture(session_name: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session_name], capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_workbench_run_in_a_real_terminal(tmp_path):
    out = tmp_path / "out"
    status = tmp_path / "exit-code"
    name = f"wb-{tmp_path.name}"[:40]
    workbench = Path(sys.executable).with_name("workbench")
    command = (f"cd {ROOT} && {workbench} run examples/tiny-gpt.toml --set training.output_dir={out} "
               f"--set training.max_steps=5000 --set training.save_strategy=no; echo $? > {status}")
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "100", "-y", "30", command], check=True)
    try:
        def wait_screen(condition, what: str, timeout: float = 240.0) -> str:
            deadline = time.monotonic() + timeout
            while True:
                screen = _capture(name)
                if condition(screen):
                    return screen
                if time.monotonic() > deadline or status.exists():
                    raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen}")
                time.sleep(0.5)

        import re

        def trained(screen: str) -> bool:
            match = re.search(r"step (\d+)/5000", screen)
            return "RUNNING" in screen and match is not None and int(match.group(1)) >= 55

        # Two log points (logging_steps 25): a line needs two; one point draws nothing.
        wait_screen(trained, "the dashboard training past step 55 (two log points)")
        subprocess.run(["tmux", "send-keys", "-t", name, "space"], check=True)
        screen = wait_screen(lambda s: "PAUSED" in s, "the PAUSED badge")
        assert "loss" in screen and "eval" in screen
        assert any(ch in screen for ch in "⠁⠂⠄⡀⢀⠠⠐⠈⣀⠤⠒⠉"), f"no chart line drawn:\n{screen}"  # braille dots
        step = int(re.search(r"step (\d+)/5000", screen).group(1))
        time.sleep(1.0)
        assert f"step {step}/5000" in _capture(name), "the step moved while paused"

        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        wait_screen(lambda s: "Stop and save" in s, "the quit dialog")
        subprocess.run(["tmux", "send-keys", "-t", name, "Enter"], check=True)
        deadline = time.monotonic() + 120
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status.read_text().strip() == "0"
        checkpoints = CheckpointStore(out).list()
        # Stopped while paused: saved at the paused step, no further step trained.
        assert [c.step for c in checkpoints] == [step]
        assert CheckpointStore(out).verify(checkpoints[0].path) == (True, None)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
