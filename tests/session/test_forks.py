"""A/B forks from a paused run (issue 28): variants train the same batches with the same
random streams from the pause, one after another, are evaluated, and the run goes back to
the pause; ``keep`` continues from a variant bitwise as if its change had been made at the
pause, ``discard`` leaves the run bitwise as if it had never forked. Real runs, real
Sessions, attached over the control endpoint too."""

from __future__ import annotations

import pytest

from workbench import attach
from workbench.core.event_file import read_events

from support import DEADLINE, assert_same_weights, finish, make_session, wait_until
from support.steering import PauseAt

PAUSE, STEPS, TOTAL = 20, 10, 60  # 32 batches an epoch: the kept runs cross epochs afterwards


def run_to(out, sessions, pause: int | None = PAUSE, **kwargs):
    """The small MLP run (evaluated every 20 steps), started, paused after step ``pause``."""
    callbacks = [PauseAt(pause)] if pause else []
    session = make_session(out, callbacks=callbacks, max_steps=TOTAL, eval_strategy="steps", eval_steps=20, **kwargs)
    sessions.append(session)
    for cb in callbacks:
        cb.session = session
    session.start()
    if pause:
        wait_until(lambda: session.status == "paused", f"the pause at step {pause}")
        assert session.snapshot().step == pause
    return session


def weights(session) -> dict:
    return {k: v.clone() for k, v in session.model.state_dict().items()}


VARIANTS = {"a": {}, "b": {"learning_rate": 1e-3}, "c": {"schedule": "decay_now steps=10 shape=cosine"}}


def test_three_variants_train_the_same_batches_and_discard_is_never_forked(tmp_path, sessions):
    never = run_to(tmp_path / "never", sessions, pause=None)
    assert finish(never) == "finished"

    session = run_to(tmp_path / "fork", sessions)
    cost = session.fork_cost(VARIANTS, STEPS)
    assert cost["bytes"] == 4 * cost["bytes_each"] > 0 and cost["fits"]
    report = session.fork(VARIANTS, steps=STEPS)
    assert report["state"] == "done" and report["step"] == PAUSE and report["memory"]["bytes"] == cost["bytes"]
    variants = report["variants"]
    batches = [v["batches"] for v in variants.values()]
    assert len(batches[0]) == STEPS and batches[0] == batches[1] == batches[2]  # the same data, step by step
    assert [p[0] for p in variants["a"]["loss"]] == list(range(PAUSE + 1, PAUSE + STEPS + 1))
    assert all("eval_loss" in v["eval"] for v in variants.values()) and "eval_loss" in report["parent"]["eval"]
    assert variants["a"]["loss"] != variants["b"]["loss"]  # the change made a difference
    assert variants["c"]["changes"]["schedule"]["at"] == PAUSE
    # The run is back at the pause, and told nobody of the variants but through the report.
    assert session.snapshot().step == PAUSE and session.snapshot().max_steps == TOTAL
    assert session.snapshot().fork["variants"].keys() == VARIANTS.keys()
    assert session.trainer.workbench_state.live_edits == [] and not session.snapshot().edits
    assert not [e for e in read_events(tmp_path / "fork") if e["event"] == "edit"]
    session.discard()
    assert session.snapshot().fork["state"] == "discarded"
    session.resume()
    assert finish(session) == "finished"
    assert_same_weights(never.model, session.model)


def test_keep_is_bitwise_the_run_that_made_the_change_at_the_pause(tmp_path, sessions):
    changed = run_to(tmp_path / "changed", sessions)
    changed.set(learning_rate=1e-3)
    later = PauseAt(PAUSE + STEPS)
    changed.trainer.add_callback(later)
    later.session = changed
    changed.resume()
    wait_until(lambda: changed.status == "paused" and changed.snapshot().step == PAUSE + STEPS, "the second pause")
    at_end_of_fork = weights(changed)
    changed.resume()
    assert finish(changed) == "finished"

    session = run_to(tmp_path / "fork", sessions)
    session.fork({"a": {}, "b": {"learning_rate": 1e-3}}, steps=STEPS)
    kept = session.keep("b", reason="b learns faster")
    assert kept["fork"] == {"id": 1, "kept": "b", "from_step": PAUSE, "steps": STEPS}
    assert "kept b after 10 steps" in kept["reason"] and "eval_loss" in kept["reason"] and "b learns faster" in kept["reason"]
    assert session.snapshot().step == PAUSE + STEPS and session.status == "paused"
    assert_same_weights(at_end_of_fork, session.model)
    edits = session.trainer.workbench_state.live_edits
    assert [(e["step"], "learning_rate" in e, "fork" in e) for e in edits] == [(PAUSE, True, False),
                                                                            (PAUSE + STEPS, False, True)]
    assert [e["event"] for e in read_events(tmp_path / "fork") if e["event"] == "edit"] == ["edit", "edit"]
    session.resume()
    assert finish(session) == "finished"
    assert_same_weights(changed.model, session.model)  # the data went on from the variant's end, across epochs


def test_a_fork_is_refused_in_one_line_when_it_cannot_run(tmp_path, sessions):
    session = run_to(tmp_path / "fork", sessions)
    with pytest.raises(RuntimeError, match=r"need .* MiB of host memory \(3 copies .*the limit is 0.0 MiB"):
        session.fork({"a": {}, "b": {}}, steps=5, max_memory=1)
    with pytest.raises(ValueError, match="variant b: learning_rate"):
        session.fork({"a": {}, "b": {"learning_rate": -1}}, steps=5)
    with pytest.raises(ValueError, match="steps"):
        session.fork({"a": {}}, steps=0)
    with pytest.raises(RuntimeError, match="no fork to keep"):
        session.keep("a")
    session.fork({"a": {}}, steps=2, evaluate=False)
    with pytest.raises(ValueError, match="no variant 'z'"):
        session.keep("z")
    session.resume()  # a resume without keep discards
    assert session.snapshot().fork["state"] == "discarded"
    with pytest.raises(RuntimeError, match="pause the run first"):
        session.fork({"a": {}}, steps=2)


def test_fork_and_keep_over_attach(tmp_path, sessions):
    session = run_to(tmp_path / "fork", sessions)
    remote = attach(tmp_path / "fork")
    try:
        assert remote.fork_cost({"a": {}}, 3)["fits"]
        with pytest.raises(ValueError, match="variants"):
            remote.fork({}, steps=3)
        report = remote.fork({"slow": {"learning_rate": 1e-4}, "fast": {"learning_rate": 5e-2}}, steps=5)
        assert report["variants"]["slow"]["batches"] == report["variants"]["fast"]["batches"]
        wait_until(lambda: (remote.snapshot().fork or {}).get("state") == "done", "the report in the snapshot")
        kept = remote.keep("fast")
        assert kept["fork"]["kept"] == "fast"
        wait_until(lambda: remote.snapshot().step == PAUSE + 5, "the kept variant's step")
        remote.resume()
        assert remote.wait(DEADLINE) == "finished"
    finally:
        remote.close()
    assert [e.get("learning_rate") for e in session.trainer.workbench_state.live_edits] == [5e-2, None]
