"""The Session: real training threads on a tiny model, steered from other threads.

Every test trains for real (TinyGPT with one layer on the standard library's source, or
the small MLP) in the Session's worker thread and drives it the way a notebook, the
dashboard or a script would: pause/resume at random moments, evaluate/save/set while
running and while paused, stop in the middle of an evaluation, and a storm of commands from
several threads. Edits and restarts are in test_session_edits.py, what a run reports in
test_session_reports.py.

Every wait has a deadline, so a deadlock fails the test instead of hanging the suite.
No assertion depends on timing: other processes share the CPU.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from workbench import Session
from workbench.checkpoint.store import CheckpointStore
from workbench.door.values import Snapshot

from support import DEADLINE, assert_same_weights, finish, wait_until
from support.lm import lm_data, lm_trainer
from support.steering import assert_same_optimizer_state, loss_logs

# ------------------------------------------------------------- 1. pause/resume is invisible


def test_pause_resume_at_50_random_moments_is_bitwise_invisible(tmp_path, sessions):
    steps = 400  # room for 50 pauses (each lands on a new step) however fast the machine is
    baseline = Session(lm_trainer(tmp_path / "a", max_steps=steps, dropout=0.1))
    sessions.append(baseline)
    assert finish(baseline.start()) == "finished"

    trainer = lm_trainer(tmp_path / "b", max_steps=steps, dropout=0.1)
    session = Session(trainer)
    sessions.append(session)
    rng = random.Random(1234)
    session.start()
    paused_steps, did = [], {"evaluate": 0, "inspect": 0, "sample": 0}
    for i in range(50):
        time.sleep(rng.uniform(0.0, 0.006))
        status = session.pause(wait=True, timeout=DEADLINE)
        assert status == "paused", f"pause {i}: status {status} (raise max_steps if the run ended)"
        step = trainer.state.global_step
        paused_steps.append(step)
        time.sleep(rng.uniform(0.0, 0.003))
        assert session.snapshot().step == step  # the worker is really blocked
        if i % 10 == 3:
            metrics = session.evaluate()
            assert isinstance(metrics, dict) and metrics["eval_loss"] > 0
            did["evaluate"] += 1
        elif i % 10 == 6:
            report = session.inspect()
            assert report["step"] == step and report["layers"] and report["learning_rates"]
            did["inspect"] += 1
        elif i % 10 == 8:
            text = session.sample("def ", max_new_tokens=12)
            assert isinstance(text, str) and 0 < len(text) <= 12
            did["sample"] += 1
        assert session.model.training, "the model must be back in train mode before resuming"
        assert trainer.state.global_step == step
        assert session.resume() == "running"
    assert finish(session) == "finished"
    assert len(set(paused_steps)) > 1 and paused_steps[-1] < steps
    assert all(did.values())

    assert trainer.state.global_step == baseline.trainer.state.global_step == steps
    assert_same_weights(baseline.model, session.model)
    assert_same_optimizer_state(baseline.trainer, trainer)
    assert loss_logs(baseline.trainer) == loss_logs(trainer)
    assert len(loss_logs(trainer)) == steps // 5


def test_pause_right_after_resume_reaches_paused(tmp_path, sessions):
    # resume() then pause() before the worker has woken up: the worker never leaves its
    # wait, and the status must still say "paused" (not "pausing" forever).
    trainer = lm_trainer(tmp_path, max_steps=100_000)
    session = Session(trainer)
    sessions.append(session)
    session.start()
    assert session.pause(wait=True, timeout=DEADLINE) == "paused"
    for i in range(30):
        session.resume()
        if i % 2:
            time.sleep(0.0005)
        assert session.pause(wait=True, timeout=10) == "paused", f"round {i}: {session.status}"
        assert session.evaluate()["eval_loss"] > 0 if i % 10 == 0 else True
    session.stop(save=False)
    assert finish(session) == "stopped"


# ------------------------------------------------- 2. evaluate / save / set, running and paused


def test_evaluate_save_set_while_running_and_while_paused(tmp_path, sessions):
    trainer = lm_trainer(tmp_path, max_steps=100_000, lr_scheduler_type="constant", logging_steps=2)
    session = Session(trainer)
    sessions.append(session)
    session.start()
    wait_until(lambda: trainer.state.global_step >= 2, "the first steps")

    # Running: each command returns a Future that the worker resolves at a step end.
    f_eval = session.evaluate()
    assert isinstance(f_eval, Future)
    metrics = f_eval.result(timeout=DEADLINE)
    assert metrics["eval_loss"] > 0

    f_save = session.save()
    assert isinstance(f_save, Future)
    path = Path(f_save.result(timeout=DEADLINE))
    assert path.parent == tmp_path and path.name.startswith("checkpoint-") and path.is_dir()
    assert CheckpointStore(tmp_path).verify(path) == (True, None)

    f_set = session.set(learning_rate=1e-3)
    assert isinstance(f_set, Future)
    assert f_set.result(timeout=DEADLINE) == {"learning_rate": 1e-3}
    edit_step = trainer.workbench_state.live_edits[-1]["step"]
    wait_until(lambda: trainer.state.global_step >= edit_step + 4, "steps after the edit")
    assert trainer.get_learning_rates() == [1e-3] * len(trainer.optimizer.param_groups)
    assert all(g["lr"] == 1e-3 for g in trainer.optimizer.param_groups)
    logged = [(e["step"], e["learning_rate"]) for e in loss_logs(trainer)]
    # As in HF 5.x, a log's learning_rate is the rate its step used; the edit is applied at
    # the end of edit_step, so the steps after it use (and log) the new rate.
    assert {lr for step, lr in logged if step <= edit_step} == {3e-3}
    assert {lr for step, lr in logged if step > edit_step} == {1e-3}

    # Bad edits fail at once, before anything is queued.
    for bad in ({"momentum": 0.9}, {"learning_rate": -1.0}, {"learning_rate": float("nan")},
                {"logging_steps": 0}, {"max_steps": 2.5}, {"lr_scale": 0}, {"save_steps": True}):
        with pytest.raises(ValueError):
            session.set(**bad)
    assert session._commands.empty()

    # Paused: the same commands run in this thread and return their results directly.
    assert session.pause(wait=True, timeout=DEADLINE) == "paused"
    step = trainer.state.global_step
    metrics = session.evaluate()
    assert isinstance(metrics, dict) and metrics["eval_loss"] > 0
    assert session.model.training
    path = session.save()
    assert isinstance(path, Path) and path.name == f"checkpoint-{step}"
    assert CheckpointStore(tmp_path).verify(path) == (True, None)
    assert session.set(learning_rate=2e-3, logging_steps=3) == {"learning_rate": 2e-3, "logging_steps": 3}
    assert trainer.get_learning_rates() == [2e-3] * len(trainer.optimizer.param_groups)
    assert all(g["lr"] == 2e-3 for g in trainer.optimizer.param_groups)
    assert trainer.state.logging_steps == 3
    with pytest.raises(ValueError, match="below the current step"):
        session.set(learning_rate=5e-3, max_steps=max(step - 1, 1))
    assert trainer.get_learning_rates()[0] == 2e-3, "a refused set() must change nothing"
    with pytest.raises(ValueError):
        session.set(nonsense=1)
    assert trainer.state.global_step == step and session.status == "paused"
    assert session.snapshot().edits[-1]["learning_rate"] == 2e-3

    session.resume()
    f_end = session.set(max_steps=step + 4)
    assert f_end.result(timeout=DEADLINE)["max_steps"] == step + 4
    assert finish(session) == "finished"
    assert trainer.state.global_step == step + 4
    assert {e["learning_rate"] for e in loss_logs(trainer) if e["step"] > step} == {2e-3}


def test_stop_during_evaluation_stops_and_saves(tmp_path, sessions):
    train, big_eval = lm_data(max_chars=60000, eval_fraction=0.5)
    assert len(big_eval) > 500
    trainer = lm_trainer(tmp_path, train=train, eval_dataset=big_eval, max_steps=100_000,
                         per_device_eval_batch_size=1)
    session = Session(trainer)
    sessions.append(session)
    session.start()
    wait_until(lambda: trainer.state.global_step >= 1, "the first step")
    f_eval = session.evaluate()
    wait_until(lambda: session.status == "evaluating", "the evaluation to start", every=0.0005)
    assert session.stop() == "stopping"
    assert finish(session) == "stopped"
    assert session.snapshot().status == "stopped"
    metrics = f_eval.result(timeout=DEADLINE)
    assert metrics.get("eval_interrupted") is True  # it did not run all ~900 batches
    step = trainer.state.global_step
    ckpt = tmp_path / f"checkpoint-{step}"
    assert ckpt.is_dir() and CheckpointStore(tmp_path).verify(ckpt) == (True, None)
    assert step < 100_000


# ------------------------------------------------------------------ 3. a storm of commands


def test_storm_of_1000_random_commands_from_4_threads(tmp_path, sessions):
    trainer = lm_trainer(tmp_path, max_steps=300, logging_steps=4, save_total_limit=3)
    session = Session(trainer)
    sessions.append(session)
    futures: list[Future] = []
    errors: list[BaseException] = []
    counts: dict[str, int] = {}
    lock = threading.Lock()
    start = threading.Barrier(5)

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        start.wait(DEADLINE)
        for _ in range(250):
            kind = rng.choices(["pause", "resume", "save", "evaluate", "lr_scale", "logging_steps", "snapshot"],
                               weights=[4, 4, 1, 1, 2, 2, 4])[0]
            try:
                if kind == "pause":
                    session.pause(wait=rng.random() < 0.3, timeout=10)
                elif kind == "resume":
                    session.resume()
                elif kind == "save":
                    result = session.save()
                elif kind == "evaluate":
                    result = session.evaluate()
                elif kind == "lr_scale":
                    result = session.set(lr_scale=rng.uniform(0.9, 1.1))
                elif kind == "logging_steps":
                    result = session.set(logging_steps=rng.randint(1, 8))
                else:
                    snap = session.snapshot()
                    assert isinstance(snap, Snapshot) and snap.step <= snap.max_steps
                    result = None
                if kind in ("save", "evaluate", "lr_scale", "logging_steps") and isinstance(result, Future):
                    with lock:
                        futures.append(result)
            except RuntimeError as exc:
                if "the session is" not in str(exc):  # only "cannot save/edit: the session is finished"
                    with lock:
                        errors.append(exc)
            except BaseException as exc:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(exc)
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
            time.sleep(rng.uniform(0, 0.002))

    threads = [threading.Thread(target=storm, args=(seed,), daemon=True) for seed in range(4)]
    for t in threads:
        t.start()
    session.start()
    start.wait(DEADLINE)
    for t in threads:
        t.join(DEADLINE)
    assert not any(t.is_alive() for t in threads), "a command deadlocked"
    assert not errors, errors[:3]
    assert sum(counts.values()) == 1000

    session.resume()
    status = finish(session)
    assert status in ("finished", "stopped")
    snap = session.snapshot()
    assert snap.status == status == session.status
    assert snap.step == trainer.state.global_step
    assert status == "stopped" or trainer.state.global_step == 300

    for f in futures:  # every Future resolved: a result or an exception, none pending
        f.exception(timeout=DEADLINE)
        assert f.done()
    assert futures and any(f.exception() is None for f in futures)

    store = CheckpointStore(tmp_path)
    folders = sorted(tmp_path.glob("checkpoint-*"))
    assert folders
    for folder in folders:
        assert store.verify(folder) == (True, None), folder
    assert not list(tmp_path.glob(".tmp-*"))
