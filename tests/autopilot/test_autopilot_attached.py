"""The autopilot over attach (issue 28): the same policies and limits steer a run through a
RemoteSession (``workbench.attach``), reading its events over the control endpoint and
sending each change with its reason as any client would. The run is a real Session on the
small MLP whose eval_score is scripted (tests/autopilot/test_autopilot.py)."""

from __future__ import annotations

import pytest

from workbench import attach
from workbench.autopilot import Action, Autopilot, Limits, PlateauPolicy

from support import DEADLINE, finish, wait_until
from support.autopilot import FLAT, Asks, edits, scripted_run
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
        wait_until(lambda: pilot.proposals(), "the proposal")
        assert edits(session) == []
        proposal = pilot.proposals()[0]
        assert pilot.accept(proposal.id).state in ("sent", "applied")
        wait_until(lambda: [e.get("lr_scale") for e in edits(session)] == [0.5], "the accepted change")
        wait_until(lambda: pilot.proposals(), "the revert, proposed")
        revert = pilot.proposals()[0]
        assert revert.kind == "revert" and revert.reverts == proposal.id and revert.changes == {"lr_scale": 2.0}
        pilot.accept(revert.id)
        wait_until(lambda: len(edits(session)) == 2, "the revert")
        assert edits(session)[1]["reason"].startswith("autopilot/plateau (accepted): revert #")
        assert session.trainer.lr_scheduler.base_lrs == [pytest.approx(1e-2)]
        pilot.stop()
        remote.stop(save=False)
        finish(session)
    finally:
        remote.close()
