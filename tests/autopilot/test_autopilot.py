"""The autopilot (issue 28): policies steering a real run within limits, as a client.

Each test runs a real Session on the small MLP. Evaluation metrics are scripted through the
run's own ``compute_metrics`` hook (each evaluation returns the next value of a list), so a
plateau, and a change that makes the metric worse, happen at known evaluations whatever the
timing; the autopilot polls in its own thread as it would on any run. What the run did is
read from the run itself: its live-edit records (with their reasons) and its base rates.
"""

from __future__ import annotations

import pytest

from workbench.autopilot import Action, Autopilot, Limits, PlateauPolicy, SpikePolicy

from support import DEADLINE, Slow, finish, wait_until
from support.autopilot import FLAT, Asks, edits, scripted_run


def test_a_scripted_plateau_starts_the_decay_exactly_once(tmp_path, sessions):
    session = scripted_run(tmp_path / "run", sessions, FLAT, max_steps=400)
    pilot = Autopilot(session, PlateauPolicy(metric="eval_score", patience=3, action="decay", decay_steps=20),
                      Limits({"decay_now": {"steps": (10, 50)}}), watch="eval_score", interval=0.02)
    session.start()
    pilot.start()
    assert finish(session) == "finished"
    pilot.stop()
    made = edits(session)
    assert len(made) == 1, made
    change = made[0]["schedule"]
    assert change["op"] == "decay_now" and change["steps"] == 20
    assert made[0]["reason"].startswith("autopilot/plateau: eval_score 0.7 ")
    assert "for 3 evaluations" in made[0]["reason"]
    # The third flat evaluation is at step 30: the decay starts after it, and the run ends with it.
    assert change["at"] >= 30 and session.trainer.state.global_step == change["at"] + 20 < 400
    assert [d.state for d in pilot.decisions] == ["applied"]


def test_a_change_outside_the_limits_is_refused_and_never_sent(tmp_path, sessions):
    session = scripted_run(tmp_path / "run", sessions, [1.0])
    policy = Asks(Action({"learning_rate": 1.0}, "go faster"), Action({"lr_scale": 4.0}, "much faster"),
                  Action({"schedule": "rewarm steps=0 peak=1"}, "restart"),
                  Action({"schedule": {"op": "decay_now", "steps": 5000}}, "a long cooldown"),
                  Action({"lr_scale": 0.5}, "a little slower"), Action({"lr_scale": 0.5}, "slower again"))
    limits = Limits({"lr_scale": (0.25, 1.0), "decay_now": {"steps": (10, 500)}}, max_changes=1, per_steps=1000)
    pilot = Autopilot(session, policy, limits)
    session.start()
    session.pause(wait=True, timeout=DEADLINE)
    for _ in range(6):
        pilot.step()
    states = [(d.state, d.note) for d in pilot.decisions]
    assert states[0] == ("refused", "refused: learning_rate is not allowed (allowed: lr_scale in [0.25, 1]; "
                                    "schedule decay_now (steps in [10, 500]))")
    assert states[1] == ("refused", "refused: lr_scale=4.0 is outside its range [0.25, 1]")
    assert states[2][0] == "refused" and states[2][1].startswith("refused: schedule rewarm is not allowed")
    assert states[3] == ("refused", "refused: decay_now steps=5000 is outside its range [10, 500]")
    assert states[4][0] == "applied"
    step = session.snapshot().step
    assert states[5] == ("refused", f"refused: 1 change(s) in the last 1000 steps (at most 1); the next is "
                                    f"allowed at step {step + 1000}")
    assert len(policy.declined_notes) == 5  # the policy hears of each refusal
    # Only the allowed change reached the run, with its reason.
    assert [(e.get("lr_scale"), e["reason"]) for e in edits(session)] == [
        (0.5, "autopilot/asks: a little slower")]
    assert session.trainer.lr_scheduler.base_lrs == [pytest.approx(5e-3)]
    with pytest.raises(ValueError, match="not a live edit"):
        Limits({"weight_decay": (0, 1)})
    with pytest.raises(ValueError, match="low <= high"):
        Limits({"lr_scale": (1.0, 0.5)})


def test_a_change_that_makes_the_metric_worse_is_reverted(tmp_path, sessions):
    # Flat at 0.8 for three evaluations (the halving), then worse and worse.
    values = [1.0, 0.9, 0.8, 0.8, 0.8, 0.8] + [0.9 + 0.01 * i for i in range(40)]
    session = scripted_run(tmp_path / "run", sessions, values, max_steps=150, slow=0.01)
    pilot = Autopilot(session, PlateauPolicy(metric="eval_score", patience=3, max_actions=1),
                      Limits({"lr_scale": (0.25, 1.0)}), watch="eval_score", revert_after=2, revert_margin=0.01,
                      interval=0.02)
    session.start()
    pilot.start()
    assert finish(session) == "finished"
    pilot.stop()
    made = edits(session)
    assert [e["lr_scale"] for e in made] == [0.5, 2.0]
    assert made[0]["reason"].startswith("autopilot/plateau: eval_score 0.8 ")
    assert made[1]["reason"].startswith("autopilot/plateau: revert #1 (lr_scale=0.5): eval_score ")
    assert "after 2 evaluations is worse than" in made[1]["reason"]
    assert session.trainer.lr_scheduler.base_lrs == [pytest.approx(1e-2)]  # back where it was
    kinds = [(d.kind, d.state, d.reverts) for d in pilot.decisions]
    assert kinds == [("change", "applied", None), ("revert", "applied", 1)]


def test_a_change_that_helps_is_kept(tmp_path, sessions):
    values = [1.0, 0.9, 0.8, 0.8, 0.8, 0.8] + [0.7 - 0.01 * i for i in range(40)]
    session = scripted_run(tmp_path / "run", sessions, values, max_steps=120, slow=0.01)
    pilot = Autopilot(session, PlateauPolicy(metric="eval_score", patience=3), Limits({"lr_scale": (0.25, 1.0)}),
                      watch="eval_score", revert_after=2, interval=0.02)
    session.start()
    pilot.start()
    assert finish(session) == "finished"
    pilot.stop()
    assert [e["lr_scale"] for e in edits(session)] == [0.5]


def test_dry_run_changes_nothing_until_accepted(tmp_path, sessions):
    session = scripted_run(tmp_path / "run", sessions, FLAT)
    pilot = Autopilot(session, PlateauPolicy(metric="eval_score", patience=3), Limits({"lr_scale": (0.25, 1.0)}),
                      watch="eval_score", dry_run=True, interval=0.02)
    session.start()
    pilot.start()
    wait_until(lambda: len(pilot.proposals()) == 1, "the first proposal")
    first = pilot.proposals()[0]
    assert first.changes == {"lr_scale": 0.5} and first.state == "proposed"
    # Three more flat evaluations: a newer proposal replaces the waiting one; nothing is sent.
    wait_until(lambda: pilot.proposals() and pilot.proposals()[0].id != first.id, "a newer proposal")
    assert pilot.decisions[first.id - 1].state == "superseded"
    # Each proposal is on the run too, for any front-end; the run's copy of a replaced one is withdrawn.
    wait_until(lambda: session.proposals()[0].state == "rejected", "the run's copy of the replaced proposal withdrawn")
    assert session.proposals()[0].decision.startswith("superseded by the autopilot's #")
    wait_until(lambda: [p.id for p in session.proposals() if p.pending] == [pilot.proposals()[0].published],
               "the newer proposal on the run, alone")
    assert edits(session) == [] and session.trainer.lr_scheduler.base_lrs == [1e-2]
    proposal = pilot.proposals()[0]
    # Deciding the replaced one names the proposal to decide instead, and changes nothing.
    for decide in (pilot.accept, pilot.reject):
        with pytest.raises(ValueError, match=rf"proposal #{first.id} was replaced by #\d+ .*decide that one"):
            decide(first.id)
    assert pilot.decisions[first.id - 1].state == "superseded"
    pilot.accept(proposal.id)
    wait_until(lambda: len(edits(session)) == 1, "the accepted change to land")
    wait_until(lambda: pilot.decisions[proposal.id - 1].state == "applied", "the decision to settle")
    # Accepted on the run (the proposal was put there): the edit's reason names the proposal and its source.
    assert edits(session)[0]["reason"].startswith(
        f"accepted proposal {proposal.published} from autopilot/plateau: eval_score 0.7 ")
    assert pilot.decisions[proposal.id - 1].sent == edits(session)[0]["reason"]
    assert session.trainer.lr_scheduler.base_lrs == [pytest.approx(5e-3)]
    wait_until(lambda: pilot.proposals(), "another proposal")
    rejected = pilot.reject(pilot.proposals()[0].id, "not now")
    assert rejected.state == "rejected" and rejected.note == "not now"
    pilot.stop()
    session.stop(save=False)
    finish(session)
    assert len(edits(session)) == 1


def test_a_proposal_replaced_while_its_rejection_reaches_the_run_is_not_an_error(tmp_path, sessions):
    """A newer proposal can land while a person's no is on its way to the run (the autopilot
    polls in its own thread): the rejection returns the replaced decision, nothing is applied,
    and the newer proposal waits."""
    session = scripted_run(tmp_path / "run", sessions, [1.0])
    policy = Asks(Action({"lr_scale": 0.5}, "slower"))
    pilot = Autopilot(session, policy, Limits({"lr_scale": (0.25, 1.0)}), dry_run=True)
    session.start()
    session.pause(wait=True, timeout=DEADLINE)
    pilot.step()
    (first,) = pilot.proposals()
    on_run = pilot._decide_on_run

    def newer_meanwhile(*args, **kwargs):
        # The poll thread's policy proposing again just before the no reaches the run: the run's
        # copy of the first is withdrawn, so the run answers that it was decided already.
        pilot._decide(policy, Action({"lr_scale": 0.5}, "slower still"), session.snapshot().step)
        return on_run(*args, **kwargs)

    pilot._decide_on_run = newer_meanwhile
    decision = pilot.reject(first.id, "no")
    assert decision.state == "superseded" and [p.reason for p in pilot.proposals()] == ["slower still"]
    assert edits(session) == [] and session.trainer.lr_scheduler.base_lrs == [1e-2]
    session.stop(save=False)
    finish(session)


def test_the_spike_policy_cools_down_after_guard_interventions(tmp_path, sessions):
    from workbench import Guard, Session, Trainer

    from support.guarded import BATCH, Poisoned, Regression
    from support.runs import make_args

    # Row 5 gives a NaN loss once an epoch (16 steps): the guard skips that step each time.
    trainer = Trainer(model=Regression(), args=make_args(tmp_path / "run", max_steps=64, learning_rate=0.05,
                                                         per_device_train_batch_size=BATCH, seed=3),
                      train_dataset=Poisoned(nan_ids=(5,)), callbacks=[Slow(0.02)], guard=Guard(nonfinite="skip"))
    session = Session(trainer)
    sessions.append(session)
    policy = SpikePolicy(factor=0.5, calm_steps=6)
    pilot = Autopilot(session, policy, Limits({"lr_scale": (0.5, 2.0)}, max_changes=8, per_steps=64), interval=0.01)
    pilot.start()  # before the run: its first look sees no intervention yet
    wait_until(lambda: policy.seen == 0, "the first look")
    session.start()
    assert finish(session) == "finished"
    pilot.stop()
    made = edits(session)
    assert session.snapshot().guard_interventions >= 2
    assert made[0]["lr_scale"] == 0.5 and "guard intervention(s) (nonfinite)" in made[0]["reason"]
    assert made[1]["lr_scale"] == 2.0 and "end the cooldown" in made[1]["reason"]
    assert all(e["lr_scale"] in (0.5, 2.0) for e in made)
