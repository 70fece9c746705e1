"""Proposals in the front-ends (issue 28): the dashboard (Pilot) and the notebook panel (real
ipywidgets) show a dry-run autopilot's proposal, and accepting it there applies it to the run as
a live edit naming the proposal; rejecting one sends nothing. With no autopilot in their process,
both list the proposals published to the run by a client elsewhere (here a client attached over
the control endpoint) and decide them through the door."""

from __future__ import annotations

import pytest

from workbench import attach
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
        await wait_for(pilot_, lambda: all(d.published for d in pilot.proposals()), "both on the run")
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
        assert edits(session)[0]["reason"] == "accepted proposal 1 from autopilot/asks: eval loss flat for 3 evaluations"
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
        wait_until(lambda: all(d.published for d in pilot.proposals()), "both on the run")
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
        assert edits(session)[0]["reason"] == "accepted proposal 1 from autopilot/asks: eval loss flat for 3 evaluations"
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


def elsewhere(session, out):
    """A client attached to the run, standing in for an agent in another process: it proposes
    two changes (the run keeps them; nothing is applied)."""
    agent = attach(out)
    agent.propose({"lr_scale": 0.5}, reason="eval loss flat for 3 evaluations", source="agent/plateau")
    agent.propose({"lr_scale": 0.25}, reason="or slower still", source="agent/plateau")
    return agent


def test_the_dashboard_lists_and_decides_the_runs_proposals_without_an_autopilot(tmp_path, sessions):
    from workbench.door.values import Proposal
    from workbench.widgets.tui.autopilot import AutopilotScreen

    out = tmp_path / "run"
    session = make_session(out, callbacks=[Slow(0.004)], max_steps=100_000)
    sessions.append(session)
    agents = []

    async def scenario(app, pilot_):
        assert app.check_action("autopilot", ()) is False  # no proposal yet, no autopilot here: no o key
        await wait_for(pilot_, lambda: (out / "control.json").exists(), "the run's endpoint")
        agents.append(elsewhere(session, out))
        await wait_for(pilot_, lambda: app.check_action("autopilot", ()), "the o key, with the run's first proposal")
        await wait_for(pilot_, lambda: "proposal 2 from agent/plateau: lr_scale=0.25" in log_text(app),
                       "the proposals in the event log")
        await press(pilot_, "o")
        await wait_for(pilot_, lambda: isinstance(app.screen, AutopilotScreen), "the proposals screen")
        screen = app.screen
        await wait_for(pilot_, lambda: len(screen.rows) == 2, "the table")
        assert all(isinstance(r, Proposal) for r in screen.rows) and [r.id for r in screen.rows] == [2, 1]
        assert "the run's proposals" in str(screen.query_one("#autopilot-head").content)
        await press(pilot_, "down")  # the older one: lr_scale=0.5
        assert screen.selected.id == 1
        await press(pilot_, "y")
        await wait_for(pilot_, lambda: len(edits(session)) == 1, "the accepted change in the run")
        assert edits(session)[0]["lr_scale"] == 0.5
        assert edits(session)[0]["reason"] == "accepted proposal 1 from agent/plateau: eval loss flat for 3 evaluations"
        await wait_for(pilot_, lambda: screen.rows[0].id == 2 and screen.rows[1].state == "applied", "the redraw")
        screen.query_one("DataTable").move_cursor(row=0)
        await press(pilot_, "n")
        await wait_for(pilot_, lambda: session.proposals()[1].state == "rejected", "the rejection")
        assert [(p.decided_by, p.decision) for p in session.proposals()] == [
            ("dashboard", None), ("dashboard", "rejected in the dashboard")]
        await wait_for(pilot_, lambda: "proposal 2 (lr_scale=0.25) rejected by dashboard" in log_text(app),
                       "the decision in the event log")
        assert len(edits(session)) == 1

    try:
        drive(session, scenario)
    finally:
        for agent in agents:
            agent.close()


def test_the_panel_lists_and_decides_the_runs_proposals_without_an_autopilot(tmp_path, sessions):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("bqplot")
    out = tmp_path / "run"
    session = make_session(out, callbacks=[Slow(0.004)], max_steps=100_000)
    sessions.append(session)
    panel = session.panel()
    agent = None
    try:
        session.start()
        tab = panel.autopilot
        assert panel.tabs.children[-1] is tab.box and panel.tabs.titles[-1] == "Autopilot" and tab.accept_button.disabled
        wait_until(lambda: (out / "control.json").exists(), "the run's endpoint")
        agent = elsewhere(session, out)
        panel.refresh()
        assert panel.tabs.titles[-1] == "Autopilot (2)"
        assert [value for _, value in tab.proposal.options] == [("run", 1), ("run", 2)]
        assert "eval loss flat for 3 evaluations" in tab.run_table.value and "pending" in tab.run_table.value
        assert "agent/plateau" in tab.run_table.value and edits(session) == []
        tab.proposal.value = ("run", 1)
        tab.accept_button.click()
        wait_until(lambda: len(edits(session)) == 1, "the accepted change in the run", DEADLINE)
        assert edits(session)[0]["reason"] == "accepted proposal 1 from agent/plateau: eval loss flat for 3 evaluations"
        wait_until(lambda: session.proposals()[0].state == "applied", "the edit to land")
        panel.refresh()
        assert panel.tabs.titles[-1] == "Autopilot (1)" and [v for _, v in tab.proposal.options] == [("run", 2)]
        assert "applied" in tab.run_table.value
        tab.reject_button.click()
        assert [(p.state, p.decided_by) for p in session.proposals()] == [("applied", "notebook"),
                                                                         ("rejected", "notebook")]
        panel.refresh()
        assert panel.tabs.titles[-1] == "Autopilot" and tab.accept_button.disabled and len(edits(session)) == 1
        assert "rejected" in panel.notice.value
        assert agent.proposals()[1].decision == "rejected in the notebook"  # the proposer hears it
    finally:
        if agent is not None:
            agent.close()
        panel.close()
