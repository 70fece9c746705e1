"""An autopilot's proposals in the front-ends (issue 28): the dashboard (Pilot) and the notebook
panel (real ipywidgets) show a dry-run autopilot's proposal, and accepting it there applies it
to the run as a live edit with the autopilot's reason; rejecting one sends nothing."""

from __future__ import annotations

import pytest

from workbench.autopilot import Action, Autopilot, Limits

from support import DEADLINE, Slow, make_session, wait_until
from support.autopilot import Asks, edits
from support.dashboard import drive, log_text, press, wait_for


def proposing(tmp_path, sessions):
    """A slowed run and a dry-run autopilot whose two policies propose a change each."""
    session = make_session(tmp_path / "run", callbacks=[Slow(0.004)], max_steps=100_000)
    sessions.append(session)
    policies = [Asks(Action({"lr_scale": 0.5}, "eval loss flat for 3 evaluations")),
                Asks(Action({"lr_scale": 0.25}, "or slower still"), name="slower")]
    pilot = Autopilot(session, policies, Limits({"lr_scale": (0.25, 1.0)}, max_changes=4), dry_run=True,
                      interval=0.05)
    return session, pilot


def test_the_dashboard_shows_a_proposal_and_accepting_it_applies_it(tmp_path, sessions):
    from workbench.widgets.tui.autopilot import AutopilotScreen

    session, pilot = proposing(tmp_path, sessions)

    async def scenario(app, pilot_):
        pilot.start()
        await wait_for(pilot_, lambda: len(pilot.proposals()) == 2, "two proposals")
        await wait_for(pilot_, lambda: "[proposed]: eval loss flat for 3 evaluations" in log_text(app),
                       "the proposal in the event log")
        assert edits(session) == []  # a proposal changes nothing
        await press(pilot_, "o")
        await wait_for(pilot_, lambda: isinstance(app.screen, AutopilotScreen), "the autopilot screen")
        screen = app.screen
        await wait_for(pilot_, lambda: screen.rows and screen.selected is not None, "the table")
        assert [d.state for d in screen.rows] == ["proposed", "proposed"]
        assert "lr_scale in [0.25, 1]" in str(screen.query_one("#autopilot-head").content)
        # The newest first: move to "eval loss flat" (#1) and accept it; reject the other.
        await press(pilot_, "down")
        assert screen.selected.id == 1
        await press(pilot_, "y")
        await wait_for(pilot_, lambda: len(edits(session)) == 1, "the accepted change in the run")
        assert edits(session)[0]["lr_scale"] == 0.5
        assert edits(session)[0]["reason"] == "autopilot/asks (accepted): eval loss flat for 3 evaluations"
        await wait_for(pilot_, lambda: screen.rows and screen.rows[0].state == "proposed" and screen.rows[0].id == 2,
                       "the table redrawn")
        screen.query_one("DataTable").move_cursor(row=0)
        await press(pilot_, "n")
        await wait_for(pilot_, lambda: pilot.decisions[1].state == "rejected", "the rejection")
        await press(pilot_, "escape")
        await wait_for(pilot_, lambda: "#1 step" in log_text(app) and "[applied]" in log_text(app),
                       "the applied change in the log")
        assert len(edits(session)) == 1

    drive(session, scenario, autopilot=pilot)
    pilot.stop()


def test_the_dashboard_offers_no_autopilot_key_without_one(tmp_path, sessions):
    session = make_session(tmp_path / "run", callbacks=[Slow(0.004)], max_steps=100_000)
    sessions.append(session)

    async def scenario(app, pilot_):
        assert app.check_action("autopilot", ()) is False
        await press(pilot_, "o")
        assert app.screen is app.dashboard

    drive(session, scenario)


def test_the_panel_shows_a_proposal_and_accepting_it_applies_it(tmp_path, sessions):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("bqplot")
    session, pilot = proposing(tmp_path, sessions)
    panel = session.panel(autopilot=pilot)
    try:
        session.start()
        pilot.start()
        wait_until(lambda: len(pilot.proposals()) == 2, "two proposals")
        panel.refresh()
        tab = panel.autopilot
        assert panel.tabs.children[-1] is tab.box and panel.tabs.titles[-1] == "Autopilot (2)"
        assert [value for _, value in tab.proposal.options] == [1, 2]
        assert "eval loss flat for 3 evaluations" in tab.table.value and "proposed" in tab.table.value
        assert "lr_scale in [0.25, 1]" in tab.head.value
        assert edits(session) == []
        tab.proposal.value = 1
        tab.accept_button.click()
        wait_until(lambda: len(edits(session)) == 1, "the accepted change in the run", DEADLINE)
        assert edits(session)[0]["reason"] == "autopilot/asks (accepted): eval loss flat for 3 evaluations"
        wait_until(lambda: pilot.decisions[0].state == "applied", "the decision to settle")
        panel.refresh()
        assert panel.tabs.titles[-1] == "Autopilot (1)" and [v for _, v in tab.proposal.options] == [2]
        assert "applied" in tab.table.value
        tab.reject_button.click()
        assert pilot.decisions[1].state == "rejected" and len(edits(session)) == 1
        panel.refresh()
        assert panel.tabs.titles[-1] == "Autopilot" and tab.accept_button.disabled
        assert "rejected" in panel.notice.value
    finally:
        pilot.stop()
        panel.close()
