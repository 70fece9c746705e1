"""What a new user meets in the dashboard (issue 29), driven with Pilot over real runs: the
quit dialog names the step the run is at when the choice is made; ``workbench watch`` is
read-only and looks it (no steering key, no checkpoint action, a help without them); the
inspect screen and the memory panel say the gradients are freed between steps instead of
showing "-" and "0 B"; a stop says who made it."""

from __future__ import annotations

from workbench.control.watch import RecordedRun
from workbench.door.values import MemoryUsage
from workbench.widgets.tui.checkpoints import CheckpointsScreen
from workbench.widgets.tui.dialogs import QuitDialog
from workbench.widgets.tui.help import HELP_TEXT, WATCH_HELP_TEXT, HelpScreen
from workbench.widgets.tui.inspect import InspectScreen, memory_line
from workbench.widgets.tui.panels import MemoryPanel
from workbench.widgets.view import GRADS_FREED, memory_rows

from support.dashboard import drive, log_text, press, tiny_session, wait_for
from support.sessions import make_trainer


def test_the_quit_dialog_shows_the_step_the_run_is_at_now(tmp_path):
    session, _ = tiny_session(tmp_path / "run")
    shown: list[int] = []

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "q")
        await wait_for(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the quit dialog")
        dialog = app.screen
        opened = dialog.step
        # The run trains on behind the dialog; what it names follows.
        await wait_for(pilot, lambda: dialog.step >= opened + 5, "the dialog to follow the run")
        text = str(dialog.query_one("#quit-text").content)
        assert f"The run is at step {dialog.step}." in text, text
        shown.append(dialog.step)
        await press(pilot, "enter")  # stop and save
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

    app = drive(session, scenario)
    assert app.return_value == "saved" and session.status == "stopped"
    assert session.snapshot().step >= shown[0]  # saved where the dialog said, or a step or two later
    assert session.stop_reason == "dashboard"  # who stopped it, for the end record and every front-end


def _recorded(out, save_steps: int = 6) -> RecordedRun:
    trainer = make_trainer(out, max_steps=6, logging_steps=2, save_strategy="steps", save_steps=save_steps,
                           report_to=["jsonl"])
    trainer.train()
    return RecordedRun(out)


def test_watch_offers_no_steering_key_and_does_not_wait_for_a_memory_reading(tmp_path):
    run = _recorded(tmp_path / "run")
    seen: dict = {}

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: app.dashboard.query_one("#summary").display, "the summary")
        await pilot.pause(0.2)
        seen["footer"] = {str(key.description) for key in app.dashboard.query("FooterKey")}
        seen["memory"] = str(app.dashboard.query_one(MemoryPanel).render())
        seen["log"] = log_text(app)
        await press(pilot, "space", "s", "e", "l")  # refused quietly: nothing is asked of the run
        await pilot.pause(0.2)
        seen["log after keys"] = log_text(app)
        await press(pilot, "q")
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

    app = drive(run, scenario, attached=True, read_only=True)
    assert app.return_value == "finished"
    assert seen["footer"] and not seen["footer"] & {"pause", "save", "eval", "edit", "inspect"}, seen["footer"]
    assert {"ckpts", "quit"} <= seen["footer"]
    assert seen["memory"] == "no reading (the run has ended)"
    assert "read-only (workbench watch)" in seen["log"]
    assert "refused" not in seen["log after keys"] and "failed" not in seen["log after keys"]


def test_watch_offers_no_checkpoint_action_and_its_help_lists_no_steering_key(tmp_path):
    """In workbench watch, the checkpoint browser is a catalog: resume from, branch and delete
    are neither in its key bar nor run by their keys; the help lists only the keys watch has."""
    run = _recorded(tmp_path / "run", save_steps=3)  # checkpoint-3 (deletable in a steered run) and -6
    seen: dict = {}

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: app.dashboard.query_one("#summary").display, "the summary")
        await press(pilot, "c")
        await wait_for(pilot, lambda: isinstance(app.screen, CheckpointsScreen), "the checkpoint browser")
        screen = app.screen
        await pilot.pause(0.2)
        seen["footer"] = {str(key.description) for key in screen.query("FooterKey")}
        seen["title"] = str(screen.query_one("#ckpt-table").border_title)
        await press(pilot, "up")  # checkpoint-3: neither the newest nor protected
        await press(pilot, "r", "b", "d", "delete", "enter")  # each would open a dialog or a form
        await pilot.pause(0.3)
        seen["screen after keys"] = app.screen
        seen["selected"] = screen.selected.name
        await press(pilot, "escape", "question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
        seen["help"] = str(app.screen.query_one("#help-text").content)
        await press(pilot, "escape", "q")
        await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

    app = drive(run, scenario, attached=True, read_only=True)
    assert app.return_value == "finished"
    assert {"back", "help"} <= seen["footer"], seen["footer"]
    assert not seen["footer"] & {"resume from", "branch", "delete"}, seen["footer"]
    assert seen["title"] == "checkpoints (read-only)"
    assert seen["selected"] == "checkpoint-3" and isinstance(seen["screen after keys"], CheckpointsScreen)
    assert [row.name for row in run.checkpoints] == ["checkpoint-3", "checkpoint-6"]  # nothing deleted
    help_text = seen["help"]
    assert help_text == WATCH_HELP_TEXT
    for steering in ("pause", "save a checkpoint", "evaluate now", "edit hyperparameters", "inspect", "fork",
                     "resume this run", "branch", "delete it", "stop and save"):
        assert steering not in help_text, steering
    for key in ("c ", "y ", "m ", "q / ctrl+c", "home / end", "escape"):
        assert f"\n  {key}" in help_text, key
    assert "workbench attach OUTDIR or workbench ctl OUTDIR COMMAND" in help_text
    # A dashboard that steers lists every key, the checkpoint actions included (one table, two texts).
    assert "\n  r / enter   resume this run" in HELP_TEXT and "\n  space / p" in HELP_TEXT


def test_inspect_and_memory_say_the_gradients_are_freed_between_steps(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 2, "a few steps")
        await press(pilot, "i")
        await wait_for(pilot, lambda: isinstance(app.screen, InspectScreen), "the inspect screen")
        screen = app.screen
        await wait_for(pilot, lambda: screen.report is not None, "the inspection")
        table = screen.query_one("#layers")
        assert [str(c) for c in table.get_row_at(0)][3] == "freed"
        assert GRADS_FREED in str(table.border_title)
        assert f"gradients {GRADS_FREED}" in str(screen.query_one("#inspect-memory").content)
        await press(pilot, "escape")

    drive(session, scenario)


def test_the_memory_rows_show_gradients_when_there_are_some_and_say_freed_otherwise():
    def usage(grads: int) -> MemoryUsage:
        return MemoryUsage(parameters=400, gradients=grads, optimizer_state=800, device_type="cpu",
                           device_allocated=None, device_reserved=None, device_peak=None, host_rss=10, host_peak=20)

    rows = {r.label: r for r in memory_rows(usage(0))}
    assert rows["grads"].value is None and rows["grads"].note == GRADS_FREED
    rows = {r.label: r for r in memory_rows(usage(400))}
    assert rows["grads"].value == 400  # read while a step held them: the bytes, as before
    assert "gradients 400 B" in memory_line(usage(400)) and GRADS_FREED in memory_line(usage(0))


def test_a_recorded_run_stopped_from_ctl_says_so_in_watch(tmp_path):
    """The end record's stop reason, in the words every front-end uses (door/endings.py)."""
    from workbench.core.event_file import EventFile
    from workbench.widgets.view import describe_event

    log = EventFile(tmp_path)
    log.write("start", 0, max_steps=10, run_name="r", pid=1)
    log.write("end", 4, status="stopped", stop_reason="ctl", saved=True, exit_code=0, pid=1)
    run = RecordedRun(tmp_path)
    finished = [e for e in run.events_since(0)[0] if e.kind == "finished"]
    assert describe_event("finished", 4, finished[0].data) == (
        "warn", "stopped from workbench ctl at step 4, checkpoint saved (exit code 0)")
    assert run.snapshot().stop_reason == "ctl"
