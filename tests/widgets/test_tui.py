"""The terminal dashboard (workbench.widgets.tui), driven like a user drives it.

Pilot tests run the real app (``App.run_test()``) over a real tiny training run (TinyGPT,
one layer, 32-dim embeddings, on the python-source data) in its background thread, press
the real keys and check what the run did. The snapshots and pure pieces are in
test_tui_snapshots.py, a real terminal in test_tui_terminal_e2e.py. No timing assertions:
every wait is for a condition, with a generous deadline, because CI machines are shared.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from workbench import Session, Trainer, TrainingArguments
from workbench.checkpoint.store import CheckpointStore
from workbench.widgets.tui.charts import Chart
from workbench.widgets.tui.checkpoints import CheckpointsScreen
from workbench.widgets.tui.dashboard import CHART_BUDGET, CHART_BUDGET_ATTACHED, CHART_INTERVAL, CHART_INTERVAL_MAX
from workbench.widgets.tui.dialogs import ConfirmDialog, QuitDialog
from workbench.widgets.tui.forms import BranchForm, EditForm
from workbench.widgets.tui.inspect import InspectScreen
from workbench.widgets.view import fmt_number

from support import DEADLINE, REPO
from support.dashboard import badge, drive, log_text, press, tiny_session, wait_for

# ----------------------------------------------------------------------------- pilot tests: keys


def test_the_readme_guard_capture_comes_from_a_real_guarded_run(tmp_path, monkeypatch):
    """examples/guard_capture.py (the README's picture): the corrupt rows are named by the
    events of the steps that trained on them, and the dashboard lists those steps."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import guard_capture
    finally:
        sys.path.remove(str(REPO / "examples"))
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
    from workbench import Guard
    from workbench.widgets.tui.panels import GuardTable

    from support.guarded import BATCH, N, Poisoned, Regression, clean_order

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
        await wait_for(pilot, lambda: begins.starts == [0, 10], "a train() that starts at step 10")
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
