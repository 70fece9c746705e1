"""Proposals over the control endpoint (issue 28): ``propose``, ``proposals`` and ``decide``
from clients attached to a real run, ``workbench ctl OUTDIR proposals | accept N | reject N``
(run_ctl in this process, the run in a Session), and ``watch`` showing them read-only.

Several clients stand in for the several processes of the real use: an agent proposing, a
dashboard elsewhere deciding, a person at ``workbench ctl``."""

from __future__ import annotations

import json

import pytest

from workbench import attach
from workbench.control.connection import Connection
from workbench.control.ctl import run_ctl
from workbench.control.discovery import read_control
from workbench.control.watch import ReadOnly
from workbench.core.event_file import read_events

from support import finish, wait_until
from support.sessions import running


def edits(session) -> list[dict]:
    return list(session.trainer.workbench_state.live_edits)


def test_one_client_proposes_another_sees_it_and_accepts_it(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    agent, dashboard = attach(out), attach(out, client="attach")
    try:
        first = agent.propose({"lr_scale": 0.5}, reason="eval loss flat", source="agent/plateau")
        second = agent.propose({"lr_scale": "2"})  # text, as typed: parsed by the run's rule
        seen = dashboard.snapshot().proposals
        assert [(p.id, p.source, p.changes, p.state) for p in seen] == [
            (first, "agent/plateau", {"lr_scale": 0.5}, "pending"), (second, "remote", {"lr_scale": 2.0}, "pending")]
        assert dashboard.proposals() == session.proposals() == seen
        decided = dashboard.decide(first, True, reason="agreed")
        assert decided.state in ("accepted", "applied") and decided.decided_by == "attach"
        wait_until(lambda: edits(session), "the accepted change")
        assert edits(session)[0]["reason"] == "accepted proposal 1 from agent/plateau: eval loss flat; agreed"
        wait_until(lambda: agent.snapshot().proposals[0].state == "applied", "the proposer to see it applied")
        kinds = [e.kind for e in agent.events_since(0)[0]]
        assert kinds.count("proposal") == 2 and "proposal_decided" in kinds

        # Refusals arrive as the run's own one line, whichever side finds them.
        with pytest.raises(ValueError, match=r"^decide: no proposal 99 \(pending: 2\)$"):
            dashboard.decide(99, True)
        with pytest.raises(RuntimeError, match=r"^decide: proposal 1 was (accepted|applied) already \(by attach\)$"):
            agent.decide(first, False)
        with pytest.raises(ValueError, match="weight_decay"):
            agent.propose({"weight_decay": 0.1})
        conn = Connection(read_control(out))
        for args, said in [({"id": "x", "accept": True}, "id: expected a whole number"),
                           ({"id": 2}, "decide: accept is missing"),
                           ({"id": 2, "accept": "yes"}, "accept: expected true or false")]:
            with pytest.raises(ValueError, match=said):
                conn.call("decide", **args)
        with pytest.raises(ValueError, match="source: expected a short name"):
            conn.call("propose", changes={"lr_scale": 0.5}, source="")
        conn.close()

        # workbench watch shows them, and decides nothing.
        watched = ReadOnly(attach(out))
        assert [p.id for p in watched.proposals()] == [first, second]
        with pytest.raises(RuntimeError, match="^accept: workbench watch is read-only"):
            watched.decide(second, True)
        watched.close()
        assert session.proposals()[1].pending and len(edits(session)) == 1
    finally:
        agent.close()
        dashboard.close()


def test_ctl_lists_accepts_and_rejects_proposals(tmp_path, sessions, capsys):
    out = tmp_path / "run"
    session = running(out, sessions)
    session.propose({"lr_scale": 0.5}, reason="eval loss flat", source="autopilot/plateau")
    session.propose({"lr_scale": 2.0}, reason="back up", source="agent")
    capsys.readouterr()

    assert run_ctl(str(out), "proposals", []) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and listed[0].startswith("1 pending: step ")
    assert listed[0].endswith(" autopilot/plateau: lr_scale=0.5: eval loss flat")
    assert listed[1].startswith("2 pending: step ") and listed[1].endswith(" agent: lr_scale=2: back up")

    assert run_ctl(str(out), "reject", ["2"], reason="not now") == 0
    assert capsys.readouterr().out.strip() == "proposal 2 (lr_scale=2) rejected"
    assert run_ctl(str(out), "accept", ["1"]) == 0
    said = capsys.readouterr().out.strip()
    assert said in ("proposal 1 (lr_scale=0.5) accepted: the run applies it at the next step end",
                    "proposal 1 (lr_scale=0.5) accepted and applied")
    wait_until(lambda: edits(session), "the accepted change")
    assert edits(session)[0]["reason"] == "accepted proposal 1 from autopilot/plateau: eval loss flat"

    assert run_ctl(str(out), "proposals", [], as_json=True) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["state"], r["decided_by"], r["decision"]) for r in rows][1] == (2, "rejected", "ctl", "not now")

    # One line each, exit code 2: a decided proposal, an unknown one, not a number, stray arguments.
    for args, said in [(("accept", ["2"]), "ctl accept: decide: proposal 2 was rejected already (by ctl)"),
                       (("reject", ["9"]), "ctl reject: decide: no proposal 9 (pending: none pending)"),
                       (("accept", ["x"]), "ctl accept: accept: expected one proposal number"),
                       (("accept", []), "ctl accept: accept: expected one proposal number"),
                       (("proposals", ["1"]), "ctl proposals: takes no arguments")]:
        assert run_ctl(str(out), *args) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err, err
    assert run_ctl(str(out), "proposals", [], reason="why") == 2
    assert "--reason goes with set, accept, reject, keep and save_variant only" in capsys.readouterr().err
    session.stop(save=False)
    finish(session)
    decided = [(r["id"], r["state"], r["by"]) for r in read_events(out) if r["event"] == "proposal_decided"]
    assert decided[:2] == [(2, "rejected", "ctl"), (1, "accepted", "ctl")] or decided[:2] == [
        (2, "rejected", "ctl"), (1, "applied", "ctl")]
