"""The autopilot over attach (issue 28): the same policies and limits steer a run through a
RemoteSession (``workbench.attach``), reading its events over the control endpoint and
sending each change with its reason as any client would. The run is a real Session on the
small MLP whose eval_score is scripted (tests/autopilot/test_autopilot.py). In dry-run mode its
proposals go onto the run, where another client decides them and the autopilot follows."""

from __future__ import annotations

import pytest

from workbench import attach
from workbench.autopilot import Action, Autopilot, Limits, PlateauPolicy

from support import DEADLINE, finish, wait_until
from support.autopilot import FLAT, Asks, edits, scripted_run
from support.sessions import running
from support.steering import PauseAt


def attached(out, sessions, values, **kwargs):
    """A scripted run paused after step 2, and a client attached to it."""
    pause = PauseAt(2)
    session = scripted_run(out, sessions, values, **kwargs)
    session.trainer.add_callback(pause)
    pause.session = session
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 2")
    return session, attach(out)


def test_a_plateau_starts_the_decay_once_over_attach(tmp_path, sessions):
    session, remote = attached(tmp_path / "run", sessions, FLAT, max_steps=400)
    try:
        pilot = Autopilot(remote, PlateauPolicy(metric="eval_score", patience=3, action="decay", decay_steps=20),
                          Limits({"decay_now": {"steps": (10, 50)}}), watch="eval_score", interval=0.02).start()
        remote.resume()
        assert remote.wait(DEADLINE) == "finished"
        pilot.stop()
    finally:
        remote.close()
    made = edits(session)
    assert len(made) == 1 and made[0]["schedule"]["op"] == "decay_now"
    assert made[0]["reason"].startswith("autopilot/plateau: eval_score 0.7 ")
    assert session.trainer.state.global_step == made[0]["schedule"]["at"] + 20
    assert [d.state for d in pilot.decisions] == ["applied"]


def test_refusal_dry_run_and_revert_over_attach(tmp_path, sessions):
    values = [1.0, 0.9, 0.8, 0.8, 0.8, 0.8] + [0.9 + 0.01 * i for i in range(60)]
    session, remote = attached(tmp_path / "run", sessions, values, max_steps=100_000, slow=0.01)
    try:
        limits = Limits({"lr_scale": (0.25, 1.0)})
        # A forbidden change is refused on this side: never sent.
        asks = Autopilot(remote, Asks(Action({"learning_rate": 1.0}, "go faster")), limits)
        assert asks.step()[0].note.startswith("refused: learning_rate is not allowed")
        # Dry run: the plateau is proposed; nothing changes until it is accepted; then a
        # change that leaves the metric worse is reverted (proposed too, accepted).
        pilot = Autopilot(remote, PlateauPolicy(metric="eval_score", patience=3, max_actions=1), limits,
                          watch="eval_score", dry_run=True, revert_after=2, interval=0.02).start()
        remote.resume()
        wait_until(lambda: pilot.proposals() and pilot.proposals()[0].published, "the proposal, on the run")
        assert edits(session) == []
        proposal = pilot.proposals()[0]
        assert pilot.accept(proposal.id).state in ("sent", "applied")
        wait_until(lambda: [e.get("lr_scale") for e in edits(session)] == [0.5], "the accepted change")
        wait_until(lambda: pilot.proposals() and pilot.proposals()[0].published, "the revert, proposed on the run")
        revert = pilot.proposals()[0]
        assert revert.kind == "revert" and revert.reverts == proposal.id and revert.changes == {"lr_scale": 2.0}
        pilot.accept(revert.id)
        wait_until(lambda: len(edits(session)) == 2, "the revert")
        assert edits(session)[1]["reason"].startswith(f"accepted proposal {revert.published} from autopilot/plateau: "
                                                      "revert #")
        assert session.trainer.lr_scheduler.base_lrs == [pytest.approx(1e-2)]
        pilot.stop()
        remote.stop(save=False)
        finish(session)
    finally:
        remote.close()


def test_a_dry_run_autopilot_puts_its_proposals_on_the_run_and_follows_decisions_made_elsewhere(tmp_path,
                                                                                                 sessions):
    # The autopilot works through one client; a person decides through another (a dashboard elsewhere).
    out = tmp_path / "run"
    session = running(out, sessions)
    agent, person = attach(out), attach(out, client="attach")
    flat, slower = Asks(Action({"lr_scale": 0.5}, "eval loss flat")), Asks(Action({"lr_scale": 0.25}, "slower"),
                                                                            name="slower")
    pilot = Autopilot(agent, [flat, slower], Limits({"lr_scale": (0.25, 1.0)}, max_changes=1, per_steps=10**9),
                      dry_run=True, interval=0.02)
    try:
        pilot.start()
        wait_until(lambda: len(person.proposals()) == 2, "both proposals on the run")
        first, second = person.proposals()
        assert (first.source, first.changes, first.reason) == ("autopilot/asks", {"lr_scale": 0.5}, "eval loss flat")
        assert second.source == "autopilot/slower" and [d.published for d in pilot.decisions] == [first.id, second.id]
        assert edits(session) == []

        person.decide(first.id, True)
        wait_until(lambda: pilot.decisions[0].state == "applied", "the autopilot to follow the acceptance")
        assert edits(session)[0]["reason"] == f"accepted proposal {first.id} from autopilot/asks: eval loss flat"
        assert pilot.decisions[0].sent == edits(session)[0]["reason"]
        person.decide(second.id, False, reason="too slow")
        wait_until(lambda: pilot.decisions[1].state == "rejected", "the autopilot to follow the rejection")
        assert pilot.decisions[1].note == "too slow" and slower.declined_notes == ["too slow"]
        # The change accepted elsewhere counts against the limits as one the autopilot sent.
        pilot.policies.append(Asks(Action({"lr_scale": 0.5}, "again"), name="again"))
        wait_until(lambda: len(pilot.decisions) == 3, "the third ask")
        assert pilot.decisions[2].state == "refused" and "(at most 1)" in pilot.decisions[2].note
        assert len(edits(session)) == 1 and len(person.proposals()) == 2
    finally:
        pilot.stop()
        agent.close()
        person.close()
