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


def logged(session) -> list[dict]:
    """The run's training log records (log_history), the numbers a tracker would get."""
    keys = ("step", "epoch", "loss", "grad_norm", "learning_rate", "num_input_tokens_seen", "train_loss")
    return [{k: e[k] for k in keys if k in e} for e in session.trainer.state.log_history
            if "loss" in e or "train_loss" in e]


def logged_events(out) -> list[tuple]:
    return [(e["step"], e["loss"], e["learning_rate"]) for e in read_events(out) if e["event"] == "log" and "loss" in e]


# Logging every 7 steps: the last log before the pause is at 14, so the kept stretch's first
# log (21) averages losses from before the pause and of the variant, and 28 is the variant's.
COUNTED = {"logging_steps": 7, "include_num_input_tokens_seen": "all"}


def test_keep_is_bitwise_the_run_that_made_the_change_at_the_pause(tmp_path, sessions):
    changed = run_to(tmp_path / "changed", sessions, **COUNTED)
    changed.set(learning_rate=1e-3)
    later = PauseAt(PAUSE + STEPS)
    changed.trainer.add_callback(later)
    later.session = changed
    changed.resume()
    wait_until(lambda: changed.status == "paused" and changed.snapshot().step == PAUSE + STEPS, "the second pause")
    at_end_of_fork = weights(changed)
    changed.resume()
    assert finish(changed) == "finished"

    session = run_to(tmp_path / "fork", sessions, **COUNTED)
    session.fork({"a": {}, "b": {"learning_rate": 1e-3}}, steps=STEPS)
    assert [e["step"] for e in logged(session)] == [7, 14]  # the variants told the log nothing
    kept = session.keep("b", reason="b learns faster")
    assert kept["fork"] == {"id": 1, "kept": "b", "from_step": PAUSE, "steps": STEPS}
    assert "kept b after 10 steps" in kept["reason"] and "eval_loss" in kept["reason"] and "b learns faster" in kept["reason"]
    assert session.snapshot().step == PAUSE + STEPS and session.status == "paused"
    assert_same_weights(at_end_of_fork, session.model)
    edits = session.trainer.workbench_state.live_edits
    assert [(e["step"], "learning_rate" in e, "fork" in e) for e in edits] == [(PAUSE, True, False),
                                                                            (PAUSE + STEPS, False, True)]
    assert [e["event"] for e in read_events(tmp_path / "fork") if e["event"] == "edit"] == ["edit", "edit"]
    # The kept steps read as steps the run trained: logged where the loop logs, counted.
    assert [e["step"] for e in logged(session)] == [7, 14, 21, 28]
    session.resume()
    assert finish(session) == "finished"
    assert_same_weights(changed.model, session.model)  # the data went on from the variant's end, across epochs
    assert logged(session) == logged(changed)  # losses, rates, norms, epochs, tokens, train_loss: bitwise
    assert session.trainer.state.total_flos == changed.trainer.state.total_flos > 0
    assert session.trainer.state.num_input_tokens_seen == changed.trainer.state.num_input_tokens_seen > 0
    assert logged_events(tmp_path / "fork") == logged_events(tmp_path / "changed")


def test_a_kept_variants_steps_are_logged_as_the_runs_own(tmp_path, sessions):
    session = run_to(tmp_path / "fork", sessions, logging_steps=1)
    report = session.fork(VARIANTS, steps=STEPS)
    before = len(session.trainer.state.log_history)
    session.keep("c")
    variant = [tuple(p) for p in report["variants"]["c"]["loss"]]
    assert [p[0] for p in variant] == list(range(PAUSE + 1, PAUSE + STEPS + 1))
    added = session.trainer.state.log_history[before:]
    assert [(e["step"], e["loss"]) for e in added] == variant  # the steps pause+1..pause+N, the variant's losses
    events = [(e["step"], e["loss"]) for e in read_events(tmp_path / "fork") if e["event"] == "log" and "loss" in e]
    assert events[PAUSE:] == variant and [s for s, _ in events[:PAUSE]] == list(range(1, PAUSE + 1))
    assert [s for s, _ in session.snapshot().series["loss"]][-STEPS:] == [s for s, _ in variant]  # the session's curve
    session.resume()
    assert finish(session) == "finished"
    # No gap, and c's decay_now ended the run at the variant's last step: nothing trained past it.
    assert [e["step"] for e in logged(session) if "loss" in e] == list(range(1, PAUSE + STEPS + 1))
    assert session.trainer.state.global_step == PAUSE + STEPS
    assert [e["step"] for e in read_events(tmp_path / "fork") if e["event"] == "eval"] == [PAUSE, PAUSE + STEPS]


def test_a_fork_is_refused_in_one_line_when_it_cannot_run(tmp_path, sessions):
    session = run_to(tmp_path / "fork", sessions)
    with pytest.raises(RuntimeError, match=r"need .* MiB of host memory \(3 copies .*the limit is 0.0 MiB"):
        session.fork({"a": {}, "b": {}}, steps=5, max_memory=1)
    with pytest.raises(ValueError, match="variant b: learning_rate"):
        session.fork({"a": {}, "b": {"learning_rate": -1}}, steps=5)
    with pytest.raises(ValueError, match="steps"):
        session.fork({"a": {}}, steps=0)
    with pytest.raises(RuntimeError, match="keep: no fork whose variants are held"):
        session.keep("a")
    session.fork({"a": {}}, steps=2, evaluate=False)
    with pytest.raises(ValueError, match="no variant 'z'"):
        session.keep("z")
    session.resume()  # a resume without keep discards
    assert session.snapshot().fork["state"] == "discarded"
    with pytest.raises(RuntimeError, match="pause the run first"):
        session.fork({"a": {}}, steps=2)


def test_a_forks_memory_counts_every_rank_on_this_machine(tmp_path, sessions, monkeypatch):
    """Each process of a run forks with copies of its own, in the one host memory they share."""
    session = run_to(tmp_path / "fork", sessions)
    one = session.fork_cost(VARIANTS, 5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as accelerate launch sets it for 2 processes here
    two = session.fork_cost(VARIANTS, 5)
    assert (one["ranks"], two["ranks"]) == (1, 2) and two["bytes"] == 2 * one["bytes"] == 8 * one["bytes_each"]
    with pytest.raises(RuntimeError, match=r"MiB each, on each of 2 ranks of this machine\); the limit is"):
        session.fork(VARIANTS, steps=5, max_memory=one["bytes"])  # one rank's copies fit, two ranks' do not
    assert session.snapshot().fork is None and session.snapshot().step == PAUSE


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


# Dropout draws from the random streams at every step: "the same RNG" is exercised for real.
# One log a step, so every step's loss is compared.
DROPPED = {"dropout": 0.3, "logging_steps": 1}
DECAY = "decay_now steps=30 shape=cosine"
RNG_VARIANTS = {"a": {}, "b": {"learning_rate": 1e-3}, "c": {"schedule": DECAY}}


def step_losses(session, steps) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in session.trainer.state.log_history if "loss" in e and e["step"] in steps]


def test_with_dropout_keep_and_discard_are_bitwise_the_runs_that_never_forked(tmp_path, sessions):
    import torch

    never = run_to(tmp_path / "never", sessions, pause=None, **DROPPED)
    assert finish(never) == "finished"
    model, batch = never.model, torch.randn(4, 8)
    model.train()
    assert not torch.equal(model(batch)["logits"], model(batch)["logits"])  # dropout draws: two masks

    changed = run_to(tmp_path / "changed", sessions, **DROPPED)
    changed.set(schedule=DECAY)
    changed.resume()
    assert finish(changed) == "finished" and changed.trainer.state.global_step == PAUSE + 30

    forked = run_to(tmp_path / "kept", sessions, **DROPPED)
    report = forked.fork(RNG_VARIANTS, steps=STEPS)
    variants = report["variants"]
    assert variants["a"]["batches"] == variants["b"]["batches"] == variants["c"]["batches"]
    stretch = range(PAUSE + 1, PAUSE + STEPS + 1)
    # Each variant drew the masks its run draws: the unchanged one is the never-forked run, step for step.
    assert [tuple(p) for p in variants["a"]["loss"]] == step_losses(never, stretch)
    assert [tuple(p) for p in variants["c"]["loss"]] == step_losses(changed, stretch)
    assert variants["a"]["loss"] != variants["c"]["loss"]
    forked.keep("c")
    forked.resume()
    assert finish(forked) == "finished"
    assert_same_weights(changed.model, forked.model)  # the cooldown, the masks and the data went on bitwise
    assert logged(forked) == logged(changed)

    discarded = run_to(tmp_path / "discarded", sessions, **DROPPED)
    discarded.fork(RNG_VARIANTS, steps=STEPS)
    discarded.discard()
    discarded.resume()
    assert finish(discarded) == "finished"
    assert_same_weights(never.model, discarded.model)  # the variants' draws left the run's streams untouched
    assert logged(discarded) == logged(never)


def output_files(out) -> dict[str, tuple[int, int]]:
    """Every file under ``out``: its size and modification time (ns)."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file()}


def test_a_discarded_fork_writes_nothing_to_the_output_folder(tmp_path, sessions):
    out = tmp_path / "fork"
    # Saving every 5 steps: 25 and 30 fall inside the variants' stretch.
    session = run_to(out, sessions, save_strategy="steps", save_steps=5)
    session.trainer.checkpoint_writer.wait()  # the saves up to the pause are published
    before = output_files(out)
    assert "checkpoint-20/trainer_state.json" in before and "events.jsonl" in before
    session.fork(VARIANTS, steps=STEPS)
    session.discard()
    assert output_files(out) == before  # names, sizes and times: nothing written, touched or removed
    session.resume()
    assert finish(session) == "finished"
    assert (out / "checkpoint-25").is_dir()  # the run itself goes on saving


def test_a_resume_after_a_kept_fork_continues_bitwise(tmp_path, sessions):
    """Stopped with a checkpoint a few steps after keep (the unlogged loss then holds kept
    steps' losses) and resumed: the weights and the loss log of the run never stopped."""
    from workbench import Session

    from support.sessions import make_trainer
    from support.steering import StopSessionAt

    settings = dict(COUNTED, save_strategy="steps", save_steps=1000)

    def kept(out, *extra):
        session = run_to(out, sessions, **settings)
        session.fork({"a": {}, "b": {"learning_rate": 1e-3}}, steps=STEPS)
        session.keep("b")
        for cb in extra:
            session.trainer.add_callback(cb)
            cb.session = session
        session.resume()
        return session

    whole = kept(tmp_path / "whole")
    assert finish(whole) == "finished"
    stopped = kept(tmp_path / "stopped", StopSessionAt(PAUSE + STEPS + 3))
    assert finish(stopped) == "stopped" and stopped.trainer.state.global_step == PAUSE + STEPS + 3
    resumed = Session(make_trainer(tmp_path / "stopped", max_steps=TOTAL, eval_strategy="steps", eval_steps=20,
                                   **settings), resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert_same_weights(whole.model, resumed.model)
    assert [e["learning_rate"] for e in resumed.trainer.workbench_state.live_edits[:1]] == [1e-3]
    assert resumed.trainer.state.total_flos == whole.trainer.state.total_flos
    assert resumed.trainer.state.num_input_tokens_seen == whole.trainer.state.num_input_tokens_seen

    def losses(session):  # train_loss is over the steps of each train() call, as HF has it
        return [e for e in logged(session) if "loss" in e]

    assert losses(resumed) == losses(whole)
