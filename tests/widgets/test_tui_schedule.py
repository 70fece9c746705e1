"""The dashboard's schedule edits (issue 28): the edit form previews the planned learning rate
(dashed, now and after the typed change) before anything is applied, applies the change as a
live edit with its reason, and the rate chart draws the new plan dashed after the logged rate."""

from __future__ import annotations

from workbench.widgets.tui.charts import PlanChart, RateChart
from workbench.widgets.tui.forms import EditForm

from support.dashboard import drive, log_text, press, tiny_session, wait_for


def test_the_edit_form_previews_a_decay_and_applies_it(tmp_path):
    session, _ = tiny_session(tmp_path / "run", max_steps=400)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        session.pause(wait=True, timeout=60)
        step = session.snapshot().step
        rate = app.dashboard.query_one(RateChart)
        # The plan is the rest of the run: drawn from the step after the pause on.
        await wait_for(pilot, lambda: min((s for s, _ in rate.plotted.get("lr_plan") or ()), default=0) > step,
                       "the planned rate on the chart")
        await press(pilot, "l")
        await wait_for(pilot, lambda: isinstance(app.screen, EditForm), "the edit form")
        form = app.screen
        await wait_for(pilot, lambda: bool(form.query("#edit-schedule")), "the form's fields")
        chart = form.query_one(PlanChart)
        await wait_for(pilot, lambda: bool(chart.plotted.get("now")), "the current plan in the preview")
        # All of it on an 80x24 screen: the fields, the preview and the buttons.
        assert chart.region.height >= 5 and chart.region.bottom <= 24
        assert form.query_one("#form-ok").region.bottom <= 24
        assert not chart.plotted["proposed"]
        error = lambda: str(form.query_one(".form-error").content)  # noqa: E731

        form.query_one("#edit-schedule").value = "decay_now steps=0"
        await wait_for(pilot, lambda: "whole number >= 1" in error(), "the refusal, while typing")
        form.query_one("#edit-schedule").value = "decay_now steps=50 shape=cosine"
        await wait_for(pilot, lambda: bool(chart.plotted["proposed"]), "the preview of the change")
        assert max(s for s, _ in chart.plotted["proposed"]) <= step + 50 < max(s for s, _ in chart.plotted["now"])
        assert session.snapshot().max_steps == 400 and not session.snapshot().edits  # nothing applied yet
        form.query_one("#edit-reason").value = "try the cooldown"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: app.screen is not form, "the form to close")
        await wait_for(pilot, lambda: session.snapshot().max_steps == step + 50, "the edit to land")
        edit = session.snapshot().edits[-1]
        assert edit["schedule"]["op"] == "decay_now" and edit["reason"] == "try the cooldown"
        await wait_for(pilot, lambda: "set schedule=decay_now steps=50 to=0 shape=cosine" in log_text(app),
                       "the edit in the log")
        await wait_for(pilot, lambda: max(s for s, _ in rate.plotted.get("lr_plan") or [(0, 0)]) <= step + 50,
                       "the new plan on the rate chart")

    drive(session, scenario, size=(80, 24))


def test_the_fork_screen_forks_from_the_pause_draws_the_variants_and_keeps_one(tmp_path):
    from textual.widgets import DataTable, Input, TextArea

    from workbench.widgets.tui.fork import ForkChart, ForkScreen

    session, _ = tiny_session(tmp_path / "run", max_steps=400)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 4, "a few steps")
        await press(pilot, "f")
        await wait_for(pilot, lambda: isinstance(app.screen, ForkScreen), "the fork screen")
        screen = app.screen
        screen.query_one(TextArea).text = "a:\nb: learning_rate=1e-2"
        screen.query_one(Input).value = "4"
        await press(pilot, "ctrl+f")  # running: refused in one line, nothing forks
        await wait_for(pilot, lambda: any("pause the run first" in str(n.message) for n in app._notifications),
                       "the refusal")
        session.pause(wait=True, timeout=60)
        step = session.snapshot().step
        screen.query_one(TextArea).text = "a:\nb learning_rate=1e-2"
        await press(pilot, "ctrl+f")
        await wait_for(pilot, lambda: any("expected NAME: KEY=VALUE" in str(n.message) for n in app._notifications),
                       "the typing mistake said")
        screen.query_one(TextArea).text = "a:\nb: learning_rate=1e-2"
        await press(pilot, "ctrl+f")
        await wait_for(pilot, lambda: (screen.report or {}).get("state") == "done", "the fork's report", timeout=120)
        table = screen.query_one(DataTable)
        assert table.row_count == 3 and screen.names == ["a", "b"]  # the parent at the pause, then a and b
        assert "same batches" in [str(c.label) for c in table.columns.values()]
        assert [str(table.get_row_at(i)[-1]) for i in (1, 2)] == ["yes", "yes"]
        chart = screen.query_one(ForkChart)
        assert set(chart.plotted) == {"parent", "a", "b", "eval parent", "eval a", "eval b"}
        assert chart.plotted["a"][0][0] == step and chart.plotted["b"][-1][0] == step + 4  # over the parent's axis
        assert chart.plotted["a"] != chart.plotted["b"]
        # The evaluations: the parent's at the pause, each variant's after its steps, as dots.
        report = screen.report
        logged = [p for p in session.snapshot().series["eval_loss"] if p[0] < step]  # the evaluation on start
        assert logged and chart.plotted["eval parent"] == [*logged, (step, report["parent"]["eval"]["eval_loss"])]
        assert chart.plotted["eval b"] == [(step + 4, report["variants"]["b"]["eval"]["eval_loss"])]
        assert session.snapshot().step == step  # back at the pause
        # s saves the selected variant to a folder of its own; the fork stays open, and the
        # selection stays on it while the report changes, so k then keeps that same variant.
        table.move_cursor(row=2)
        table.focus()
        await press(pilot, "s")
        saved = tmp_path / "run-fork1-b" / f"checkpoint-{step + 4}"
        await wait_for(pilot, lambda: (session.snapshot().fork or {}).get("saved") == {"b": str(saved)}, "b saved")
        await wait_for(pilot, lambda: any(f"variant b saved to {saved}" in str(n.message) for n in app._notifications),
                       "the saved path said")
        await wait_for(pilot, lambda: f"b saved to {saved}" in str(screen.query_one("#fork-head").render()),
                       "the summary naming the saved variant")
        assert (saved / "model.safetensors").is_file() and session.snapshot().step == step
        assert session.snapshot().fork["state"] == "done" and table.cursor_row == 2
        await press(pilot, "k")
        await wait_for(pilot, lambda: (session.snapshot().fork or {}).get("state") == "kept", "keep b")
        await wait_for(pilot, lambda: screen.report.get("kept") == "b", "the kept mark")
        assert session.snapshot().step == step + 4
        assert "fork 1: kept b" in session.snapshot().edits[-1]["reason"]
        # The event log says it in words (the fork's own record is no "set fork={...}").
        await wait_for(pilot, lambda: f"step {step + 4}: fork 1: kept b after 4 steps" in log_text(app),
                       "the kept line in the event log")
        assert "set fork=" not in log_text(app) and f"fork 1: variant b saved to {saved}" in log_text(app)

    drive(session, scenario, size=(120, 40))
