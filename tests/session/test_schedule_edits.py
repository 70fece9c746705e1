"""Edits of the schedule's shape (issue 28): decay_now, extend, rewarm, scale_peak.

Each change is made on a real run paused at a step; the learning rate every later step
trains with is compared with the change's closed form, and the first one with the rate the
schedule had planned for it (no jump unless asked for). A resume mid-cooldown continues
bitwise; the preview is what the run then trains with; the same edits work attached.
"""

from __future__ import annotations

import math

import pytest

from workbench import Session, TrainerCallback, attach
from workbench.core.event_file import read_events

from support import DEADLINE, assert_same_weights, finish, wait_until
from support.sessions import make_trainer
from support.steering import PauseAt, StopSessionAt, assert_same_optimizer_state

BASE, WARMUP, TOTAL, AT = 1e-2, 5, 60, 20


class Rates(TrainerCallback):
    """The learning rate each optimizer step trains with, by the step's number (1-based)."""

    def __init__(self) -> None:
        self.rates: dict[int, float] = {}
        self.trainer = None

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rates[state.global_step + 1] = self.trainer.optimizer.param_groups[0]["lr"]


def cosine(step: float, total: int = TOTAL) -> float:
    """The run's own schedule (HF's cosine with warmup) as a multiplier, at scheduler step ``step``."""
    if step < WARMUP:
        return step / WARMUP
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - WARMUP) / (total - WARMUP))))


def paused_run(out, sessions, at: int = AT, extra=(), **kwargs) -> tuple[Session, Rates]:
    """A cosine run (warmup 5, 60 steps, logging every step) paused after step ``at``."""
    rates, pause = Rates(), PauseAt(at)
    settings = dict(max_steps=TOTAL, lr_scheduler_type="cosine", warmup_steps=WARMUP, logging_steps=1)
    settings.update(kwargs)
    trainer = make_trainer(out, callbacks=[rates, pause, *extra], **settings)
    rates.trainer = trainer
    session = Session(trainer)
    sessions.append(session)
    pause.session = session
    for cb in extra:
        cb.session = session
    session.start()
    wait_until(lambda: session.status == "paused", f"the pause at step {at}")
    assert trainer.state.global_step == at
    return session, rates


def weight(shape: str, p: float) -> float:
    p = min(max(p, 0.0), 1.0)
    return 1 - p if shape == "linear" else 0.5 * (1 + math.cos(math.pi * p))


@pytest.mark.parametrize("shape,to", [("linear", 0.0), ("cosine", "min_lr"), ("linear", 1e-3)])
def test_decay_now_cools_down_from_the_current_rate_and_ends_the_run(tmp_path, sessions, shape, to):
    steps = 12
    session, rates = paused_run(tmp_path / "run", sessions)
    before = dict(session.lr_plan())
    preview = session.lr_plan({"op": "decay_now", "steps": steps, "to": to, "shape": shape})
    applied = session.decay_now(steps, to=to, shape=shape, reason="eval loss flat")
    assert applied["schedule"]["op"] == "decay_now" and applied["schedule"]["at"] == AT
    assert session.snapshot().max_steps == AT + steps
    assert session.snapshot().lr_plan == preview  # what was previewed is now the plan
    session.resume()
    assert finish(session) == "finished"
    assert session.trainer.state.global_step == AT + steps
    start = cosine(AT)
    end = 0.0 if to in (0.0, "min_lr") else to / BASE  # cosine's floor is 0
    for step in range(AT + 1, AT + steps + 1):
        s = step - 1  # the scheduler step whose rate this optimizer step trains with
        expected = BASE * (end + (start - end) * weight(shape, (s - AT) / steps))
        assert rates.rates[step] == pytest.approx(expected, rel=1e-12, abs=1e-18), step
    # No jump: the first step after the edit trains with the rate planned for it before.
    assert rates.rates[AT + 1] == pytest.approx(before[AT + 1], rel=1e-12)
    assert dict(preview) == pytest.approx({k: v for k, v in rates.rates.items() if k > AT}, rel=1e-12)
    # Recorded as a live edit with its reason, in the state and in events.jsonl.
    edits = session.trainer.workbench_state.live_edits
    assert len(edits) == 1 and edits[0]["reason"] == "eval loss flat" and edits[0]["schedule"]["steps"] == steps
    logged = [e for e in read_events(tmp_path / "run") if e["event"] == "edit"]
    assert logged[0]["schedule"]["op"] == "decay_now" and logged[0]["reason"] == "eval loss flat"


def test_extend_stretches_the_rest_of_the_schedule_without_a_jump(tmp_path, sessions):
    new_total = 100
    session, rates = paused_run(tmp_path / "run", sessions)
    session.extend(new_total)
    assert session.snapshot().max_steps == new_total
    session.resume()
    assert finish(session) == "finished" and session.trainer.state.global_step == new_total
    stretch = (TOTAL - AT) / (new_total - AT)
    for step in range(1, new_total + 1):
        s = step - 1
        expected = BASE * (cosine(s) if s < AT else cosine(AT + (s - AT) * stretch))
        assert rates.rates[step] == pytest.approx(expected, rel=1e-12, abs=1e-18), step


def test_rewarm_climbs_to_the_peak_then_decays_and_a_zero_step_rewarm_jumps(tmp_path, sessions):
    steps, peak = 8, 2e-2
    session, rates = paused_run(tmp_path / "run", sessions)
    session.rewarm(steps, peak)
    session.resume()
    assert finish(session) == "finished" and session.trainer.state.global_step == TOTAL
    start, end = cosine(AT), cosine(TOTAL)
    for step in range(AT + 1, TOTAL + 1):
        s = step - 1
        if s < AT + steps:
            expected = BASE * (start + (peak / BASE - start) * (s - AT) / steps)
        else:
            expected = BASE * (end + (peak / BASE - end) * weight("cosine", (s - AT - steps) / (TOTAL - AT - steps)))
        assert rates.rates[step] == pytest.approx(expected, rel=1e-12, abs=1e-18), step
    assert rates.rates[AT + 1] == pytest.approx(BASE * start, rel=1e-12)  # continuous
    assert max(rates.rates.values()) == pytest.approx(peak, rel=1e-12)

    jumped, jumped_rates = paused_run(tmp_path / "jump", sessions)
    jumped.rewarm(0, peak)  # a jump, asked for
    jumped.resume()
    finish(jumped)
    assert jumped_rates.rates[AT + 1] == pytest.approx(peak, rel=1e-12)


def test_scale_peak_scales_the_whole_schedule(tmp_path, sessions):
    session, rates = paused_run(tmp_path / "run", sessions)
    session.scale_peak(0.5)
    session.resume()
    finish(session)
    for step in range(AT + 1, TOTAL + 1):
        assert rates.rates[step] == pytest.approx(0.5 * BASE * cosine(step - 1), rel=1e-12, abs=1e-18)


def test_changes_compose_and_one_made_while_running_lands_at_a_step_end(tmp_path, sessions):
    session, rates = paused_run(tmp_path / "run", sessions)
    session.extend(80)
    session.resume()
    future = session.decay_now(10, reason="from a script while it trains")
    applied = future.result(timeout=DEADLINE)
    at = applied["schedule"]["at"]
    assert finish(session) == "finished" and session.trainer.state.global_step == at + 10
    stretch = (TOTAL - AT) / (80 - AT)
    extended = lambda s: cosine(AT + (s - AT) * stretch)  # noqa: E731
    for step in range(at + 1, at + 11):
        expected = BASE * extended(at) * weight("linear", (step - 1 - at) / 10)
        assert rates.rates[step] == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_a_resume_mid_cooldown_continues_bitwise(tmp_path, sessions):
    common = dict(save_strategy="steps", save_steps=1000)

    def cooled(out, *extra) -> Session:
        session, _ = paused_run(out, sessions, extra=extra, **common)
        session.decay_now(20, to="min_lr", shape="cosine", reason="cool down")
        session.resume()
        return session

    whole = cooled(tmp_path / "a")
    assert finish(whole) == "finished"
    stopped = cooled(tmp_path / "b", StopSessionAt(AT + 7))
    assert finish(stopped) == "stopped"
    assert stopped.trainer.state.global_step == AT + 7  # mid-cooldown, saved
    resumed_trainer = make_trainer(tmp_path / "b", max_steps=TOTAL, lr_scheduler_type="cosine", warmup_steps=WARMUP,
                                   logging_steps=1, **common)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert resumed_trainer.state.global_step == AT + 20  # the edited max_steps came back with the record
    assert_same_weights(whole.model, resumed.model)
    assert_same_optimizer_state(whole.trainer, resumed_trainer)


@pytest.mark.parametrize("change,words", [
    ({"op": "cool"}, "is not one of"),
    ({"op": "decay_now"}, "needs steps"),
    ({"op": "decay_now", "steps": 0}, "whole number >= 1"),
    ({"op": "decay_now", "steps": 5, "shape": "cubic"}, "linear or cosine"),
    ({"op": "decay_now", "steps": 5, "to": -1}, "learning rate >= 0"),
    ({"op": "extend", "max_steps": 10}, "not after the current step"),
    ({"op": "rewarm", "steps": 100, "peak": 1e-2}, "extend the run first"),
    ({"op": "scale_peak", "factor": 0}, "positive number"),
    ({"op": "extend", "max_steps": 90, "peak": 1}, "not 'peak'"),
    ("decay_now steps", "KEY=VALUE"),
])
def test_a_bad_change_is_refused_in_one_line_and_changes_nothing(tmp_path, sessions, change, words):
    session, _ = paused_run(tmp_path / "run", sessions)
    plan = session.lr_plan()
    with pytest.raises(ValueError, match=words) as caught:
        session.set(schedule=change)
    assert "\n" not in str(caught.value)
    assert session.lr_plan() == plan and session.snapshot().max_steps == TOTAL
    assert session.trainer.workbench_state.live_edits == []


def test_text_as_typed_and_clashing_edits(tmp_path, sessions):
    session, _ = paused_run(tmp_path / "run", sessions)
    assert session.validate_edits({"schedule": "decay_now steps=10, to=min_lr shape=cosine"}) == {
        "schedule": {"op": "decay_now", "steps": 10, "to": "min_lr", "shape": "cosine"}}
    with pytest.raises(ValueError, match="not both"):
        session.set(schedule={"op": "extend", "max_steps": 90}, max_steps=70)


def test_a_plateau_schedule_takes_scale_peak_only(tmp_path, sessions):
    session, _ = paused_run(tmp_path / "run", sessions, lr_scheduler_type="reduce_lr_on_plateau",
                            eval_strategy="steps", eval_steps=10, metric_for_best_model="eval_loss")
    assert session.lr_plan() == ()
    with pytest.raises(ValueError, match="steps on evaluations"):
        session.decay_now(10)
    session.scale_peak(0.5)
    assert session.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(BASE * 0.5)


def test_schedule_edits_and_the_preview_over_attach(tmp_path, sessions):
    session, rates = paused_run(tmp_path / "run", sessions)
    remote = attach(tmp_path / "run")
    try:
        assert remote.lr_plan() == session.lr_plan()
        preview = remote.lr_plan("decay_now steps=10 shape=cosine")
        assert preview == session.lr_plan({"op": "decay_now", "steps": 10, "shape": "cosine"})
        with pytest.raises(ValueError, match="whole number"):
            remote.decay_now(None)  # type: ignore[arg-type] - refused by the run's rule
        applied = remote.decay_now(10, shape="cosine", reason="remote").result(timeout=DEADLINE)
        assert applied["schedule"]["at"] == AT
        wait_until(lambda: remote.snapshot().max_steps == AT + 10, "the edit in the snapshot")
        assert remote.snapshot().lr_plan == preview
        remote.resume()
        assert remote.wait(DEADLINE) == "finished"
        assert dict(preview) == pytest.approx({k: v for k, v in rates.rates.items() if k > AT}, rel=1e-12)
    finally:
        remote.close()


def test_a_branch_from_a_checkpoint_after_the_change_carries_it(tmp_path, sessions):
    whole, _ = paused_run(tmp_path / "whole", sessions)
    whole.decay_now(10, shape="cosine")
    whole.resume()
    assert finish(whole) == "finished"

    session, _ = paused_run(tmp_path / "run", sessions)
    session.decay_now(10, shape="cosine")
    checkpoint = session.save()
    session.stop(save=False)
    finish(session)
    branch = session.branch(checkpoint, tmp_path / "branch")
    sessions.append(branch)
    assert finish(branch.start()) == "finished"
    assert branch.trainer.state.global_step == AT + 10
    assert [e["schedule"]["op"] for e in branch.trainer.workbench_state.live_edits] == ["decay_now"]
    assert_same_weights(whole.model, branch.model)


def test_decay_now_to_min_lr_ends_at_the_schedules_floor_not_at_zero(tmp_path, sessions):
    """A schedule whose floor is not 0 (cosine_with_min_lr): to=min_lr cools down to that floor,
    to=0 to zero; both start from the current rate."""
    steps, floor = 12, 1e-3
    ends = {}
    for to in ("min_lr", 0.0):
        session, rates = paused_run(tmp_path / f"run-{to}", sessions, lr_scheduler_type="cosine_with_min_lr",
                                    lr_scheduler_kwargs={"min_lr": floor})
        applied = session.decay_now(steps, to=to, shape="cosine")
        assert applied["schedule"]["to_ratio"] == pytest.approx(floor / BASE if to == "min_lr" else 0.0, rel=1e-12)
        session.resume()
        assert finish(session) == "finished" and session.trainer.state.global_step == AT + steps
        start = (1 - floor / BASE) * cosine(AT) + floor / BASE  # the run's own rate at the pause
        end = floor / BASE if to == "min_lr" else 0.0
        for step in range(AT + 1, AT + steps + 1):
            expected = BASE * (end + (start - end) * weight("cosine", (step - 1 - AT) / steps))
            assert rates.rates[step] == pytest.approx(expected, rel=1e-12, abs=1e-18), step
        ends[to] = (session.trainer.lr_scheduler.get_last_lr()[0], rates.rates)
    assert ends["min_lr"][0] == pytest.approx(floor, rel=1e-12)  # where the cooldown ends: the floor
    assert ends[0.0][0] == 0.0
    assert ends["min_lr"][1][AT + 1] == ends[0.0][1][AT + 1]  # the same first step: no jump either way
    assert all(ends["min_lr"][1][s] > ends[0.0][1][s] for s in range(AT + 2, AT + steps + 1))


@pytest.mark.parametrize("change,stop_at", [({"op": "extend", "max_steps": 90}, AT + 7),
                                            ({"op": "rewarm", "steps": 8, "peak": 2e-2}, AT + 4),
                                            ({"op": "rewarm", "steps": 8, "peak": 2e-2}, AT + 15)])
def test_a_resume_after_extend_or_mid_rewarm_continues_bitwise(tmp_path, sessions, change, stop_at):
    """Stopped with a checkpoint after the change (mid-warmup and in the decay after a rewarm)
    and resumed: the same weights, optimizer state and rates as the run never stopped."""
    common = dict(save_strategy="steps", save_steps=1000)

    def changed(out, *extra) -> tuple[Session, Rates]:
        session, rates = paused_run(out, sessions, extra=extra, **common)
        session.set(schedule=change, reason="reshape")
        session.resume()
        return session, rates

    whole, whole_rates = changed(tmp_path / "a")
    assert finish(whole) == "finished"
    stopped, _ = changed(tmp_path / "b", StopSessionAt(stop_at))
    assert finish(stopped) == "stopped" and stopped.trainer.state.global_step == stop_at
    rates = Rates()
    resumed_trainer = make_trainer(tmp_path / "b", callbacks=[rates], max_steps=TOTAL, lr_scheduler_type="cosine",
                                   warmup_steps=WARMUP, logging_steps=1, **common)
    rates.trainer = resumed_trainer
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert resumed_trainer.state.global_step == whole.trainer.state.global_step == change.get("max_steps", TOTAL)
    assert rates.rates == {s: r for s, r in whole_rates.rates.items() if s > stop_at}  # bitwise, every step
    assert_same_weights(whole.model, resumed.model)
    assert_same_optimizer_state(whole.trainer, resumed_trainer)
