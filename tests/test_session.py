"""The Session: real training threads on a tiny model, steered from other threads.

Every test trains for real (TinyGPT with one layer on the standard library's source, or
the small MLP) in the Session's worker thread and drives it the way a notebook, the
dashboard or a script would: pause/resume at random moments, evaluate/save/set while
running and while paused, stop in the middle of an evaluation, a storm of commands from
several threads, a live edit followed by a kill and a resume, resume_from and branch, a
failing model, host-sync counting, memory figures, trackio, snapshots and events, and
Ctrl-C while ``wait()`` blocks.

Every wait has a deadline, so a deadlock fails the test instead of hanging the suite.
No assertion depends on timing: other processes share the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

from workbench import Session, Trainer, TrainerCallback, TrainingArguments
from workbench.checkpoint.store import CheckpointStore
from workbench.data.builtin import CharTokenizer, load_builtin_data
from workbench.train.memory import memory_report
from workbench.models import MLPClassifier, TinyGPT
from workbench.door.values import SeriesStore, Snapshot
from workbench.core.event_file import read_events

TOK = CharTokenizer()
TIMEOUT = 120  # seconds: generous, a deadline only (CPU is shared with other work)
_DATA: dict[tuple, tuple] = {}


# ----------------------------------------------------------------------------- helpers




def lm_data(max_chars: int = 20000, eval_fraction: float = 0.05):
    key = ("lm", max_chars, eval_fraction)
    if key not in _DATA:
        _DATA[key] = load_builtin_data("python-source", block_size=32, max_chars=max_chars,
                                       eval_fraction=eval_fraction)
    return _DATA[key]


def mlp_data():
    key = ("mlp",)
    if key not in _DATA:
        _DATA[key] = load_builtin_data("random-classification", n_train=512, n_eval=64)
    return _DATA[key]


def tiny_gpt(seed: int = 0, dropout: float = 0.0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=32, dropout=dropout)


def lm_trainer(out, *, model=None, train=None, eval_dataset=None, callbacks=None, dropout=0.0,
               **overrides) -> Trainer:
    train_default, eval_default = lm_data()
    options = dict(output_dir=str(out), max_steps=40, per_device_train_batch_size=8,
                   per_device_eval_batch_size=16, learning_rate=3e-3, logging_steps=5,
                   save_strategy="no", report_to="none", disable_tqdm=True, seed=42)
    options.update(overrides)
    return Trainer(model=model if model is not None else tiny_gpt(dropout=dropout),
                   args=TrainingArguments(**options),
                   train_dataset=train if train is not None else train_default,
                   eval_dataset=eval_dataset if eval_dataset is not None else eval_default,
                   processing_class=TOK, callbacks=callbacks)


@pytest.fixture
def sessions():
    """Sessions made by a test; any still running at the end are stopped (no stray threads)."""
    made: list[Session] = []
    yield made
    for s in made:
        if s._thread is not None and s.status not in ("finished", "stopped", "failed"):
            s.stop(save=False)
            s.resume()
            wait_until(lambda: s.status in ("finished", "stopped", "failed"), "a left-over run to stop")


def wait_until(predicate, what: str, timeout: float = TIMEOUT, every: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def finish(session: Session, timeout: float = TIMEOUT) -> str:
    """wait() with a deadline; fails (instead of hanging) if the run does not end."""
    status = session.wait(timeout)
    assert session._thread is not None and not session._thread.is_alive(), \
        f"the run did not end within {timeout}s (status {status})"
    return status


def loss_logs(trainer: Trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"


def assert_same_optimizer_state(a: Trainer, b: Trainer) -> None:
    oa = getattr(a.optimizer, "optimizer", a.optimizer).state_dict()
    ob = getattr(b.optimizer, "optimizer", b.optimizer).state_dict()
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for idx in oa["state"]:
        sa, sb = oa["state"][idx], ob["state"][idx]
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), f"optimizer state {idx}/{key} differs"
            else:
                assert sa[key] == sb[key]
    assert [g["lr"] for g in oa["param_groups"]] == [g["lr"] for g in ob["param_groups"]]


class PauseAt(TrainerCallback):
    """Asks the session to pause at the end of step ``step`` (so it blocks before the next)."""

    def __init__(self, step: int) -> None:
        self.step, self.session = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.session is not None:
            self.session.pause()


class StopSessionAt(TrainerCallback):
    """Calls session.stop(save=True) once, at the beginning of step ``step + 1``: the run
    stops at that boundary, before step ``step + 1`` runs."""

    def __init__(self, step: int) -> None:
        self.step, self.session, self.done = step, None, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.session is not None and not self.done:
            self.done = True
            self.session.stop(save=True)


class BeginSteps(TrainerCallback):
    """Records the global step each train() starts from."""

    def __init__(self) -> None:
        self.starts: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.starts.append(state.global_step)


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
        status = session.pause(wait=True, timeout=TIMEOUT)
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
    assert session.pause(wait=True, timeout=TIMEOUT) == "paused"
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
    metrics = f_eval.result(timeout=TIMEOUT)
    assert metrics["eval_loss"] > 0

    f_save = session.save()
    assert isinstance(f_save, Future)
    path = Path(f_save.result(timeout=TIMEOUT))
    assert path.parent == tmp_path and path.name.startswith("checkpoint-") and path.is_dir()
    assert CheckpointStore(tmp_path).verify(path) == (True, None)

    f_set = session.set(learning_rate=1e-3)
    assert isinstance(f_set, Future)
    assert f_set.result(timeout=TIMEOUT) == {"learning_rate": 1e-3}
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
    assert session.pause(wait=True, timeout=TIMEOUT) == "paused"
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
    assert f_end.result(timeout=TIMEOUT)["max_steps"] == step + 4
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
    metrics = f_eval.result(timeout=TIMEOUT)
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
        start.wait(TIMEOUT)
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
    start.wait(TIMEOUT)
    for t in threads:
        t.join(TIMEOUT)
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
        f.exception(timeout=TIMEOUT)
        assert f.done()
    assert futures and any(f.exception() is None for f in futures)

    store = CheckpointStore(tmp_path)
    folders = sorted(tmp_path.glob("checkpoint-*"))
    assert folders
    for folder in folders:
        assert store.verify(folder) == (True, None), folder
    assert not list(tmp_path.glob(".tmp-*"))


# ------------------------------------------------- 4. live edit, kill, resume = the edited run


def test_live_lr_edit_then_kill_and_resume_reproduces_the_edited_run(tmp_path, sessions):
    k, stop_at, steps = 8, 13, 30
    common = dict(max_steps=steps, save_strategy="steps", save_steps=5, logging_steps=5, dropout=0.1)

    def edited_session(out, *extra) -> tuple[Session, Trainer]:
        pause = PauseAt(k)
        trainer = lm_trainer(out, callbacks=[pause, *extra], **common)
        session = Session(trainer)
        sessions.append(session)
        for cb in (pause, *extra):
            cb.session = session
        session.start()
        wait_until(lambda: session.status == "paused", f"the pause at step {k}")
        assert trainer.state.global_step == k
        assert session.set(learning_rate=1e-3) == {"learning_rate": 1e-3}
        session.resume()
        return session, trainer

    session_a, trainer_a = edited_session(tmp_path / "a")
    assert finish(session_a) == "finished"

    out_b = tmp_path / "b"
    session_b, trainer_b = edited_session(out_b, StopSessionAt(stop_at))
    assert finish(session_b) == "stopped"
    saved = trainer_b.state.global_step
    assert k < saved < steps
    ckpt = out_b / f"checkpoint-{saved}"
    state = json.loads((ckpt / "workbench_state.json").read_text())  # trainer_state.json stays HF's
    assert [(e["step"], e["learning_rate"]) for e in state["live_edits"]] == [(k, 1e-3)]
    edits = [e for e in read_events(out_b) if e["event"] == "edit"]
    assert len(edits) == 1 and edits[0]["step"] == k and edits[0]["learning_rate"] == 1e-3

    # A new process would build everything again: a fresh trainer, resuming from disk.
    resumed_trainer = lm_trainer(out_b, **common)
    starts = BeginSteps()
    resumed_trainer.add_callback(starts)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert starts.starts == [saved]
    assert resumed_trainer.state.global_step == steps
    assert_same_weights(session_a.model, resumed.model)
    assert_same_optimizer_state(trainer_a, resumed_trainer)
    logs_a, logs_b = loss_logs(trainer_a), loss_logs(resumed_trainer)
    assert [e["step"] for e in logs_a] == [e["step"] for e in logs_b] == [5, 10, 15, 20, 25, 30]
    for a, b in zip(logs_a, logs_b):
        if a["step"] == 15:  # as in HF, the first log after a resume averages only the steps since
            a, b = {**a, "loss": None}, {**b, "loss": None}
        assert a == b


def _small_train(batches: int = 10):
    train, _ = lm_data()
    return Subset(train, range(batches * 8))  # `batches` steps per epoch at batch size 8


def test_max_steps_edit_beyond_the_planned_epochs_runs_to_the_new_end(tmp_path, sessions):
    # 10 steps per epoch, 15 planned (2 epochs); raised live to 26, which needs a third epoch.
    pause = PauseAt(4)
    trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, callbacks=[pause])
    session = Session(trainer)
    pause.session = session
    sessions.append(session)
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 4")
    session.set(max_steps=26)
    session.resume()
    assert finish(session) == "finished"
    assert trainer.state.global_step == 26


def test_num_train_epochs_edit_converts_with_the_planned_epoch_length(tmp_path, sessions):
    # 10 steps per epoch; max_steps 15 (so max_steps / num_train_epochs = 7.5 is no epoch length).
    pause, stop = PauseAt(4), StopSessionAt(7)
    trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50,
                         callbacks=[pause, stop])
    session = Session(trainer)
    pause.session = stop.session = session
    sessions.append(session)
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 4")
    assert session.set(num_train_epochs=3) == {"num_train_epochs": 3}
    assert trainer.state.max_steps == 30 and trainer.state.num_train_epochs == 3
    session.resume()
    assert finish(session) == "stopped"
    resumed_trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert resumed_trainer.state.global_step == 30
    assert resumed.snapshot().edits[-1]["num_train_epochs"] == 3  # the resumed session shows the edit


def test_max_steps_edit_survives_kill_and_resume(tmp_path, sessions):
    pause, stop = PauseAt(4), StopSessionAt(7)
    trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50,
                         callbacks=[pause, stop])
    session = Session(trainer)
    pause.session = stop.session = session
    sessions.append(session)
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 4")
    session.set(max_steps=26)
    session.resume()
    assert finish(session) == "stopped"
    assert trainer.state.global_step == 7 and (tmp_path / "checkpoint-7").is_dir()

    resumed_trainer = lm_trainer(tmp_path, train=_small_train(), max_steps=15, save_strategy="steps", save_steps=50)
    resumed = Session(resumed_trainer, resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert resumed_trainer.state.global_step == 26 == resumed_trainer.state.max_steps


# ----------------------------------------------------------------- 5. resume_from and branch


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_resume_from_and_branch(tmp_path, sessions):
    out = tmp_path / "main"
    stop, starts = StopSessionAt(12), BeginSteps()
    trainer = lm_trainer(out, max_steps=20, save_strategy="steps", save_steps=5, logging_steps=5,
                         lr_scheduler_type="constant", callbacks=[stop, starts])
    session = Session(trainer)
    stop.session = session
    sessions.append(session)
    assert finish(session.start()) == "stopped"
    assert trainer.state.global_step == 12
    ckpt = out / "checkpoint-10"
    assert ckpt.name in [c.name for c in session.checkpoints]

    # resume_from: the same session restarts from step 10 (not 12) and finishes.
    session.resume_from(ckpt)
    assert finish(session) == "finished"
    assert starts.starts == [0, 10]
    assert trainer.state.global_step == 20
    assert [e["step"] for e in loss_logs(trainer)] == [5, 10, 15, 20]
    assert session.snapshot().step == 20 and session.snapshot().status == "finished"

    # branch: a new session from checkpoint-10 into another folder, with another LR.
    before = _tree(out)
    branch_dir = tmp_path / "branch"
    branch = session.branch(ckpt, output_dir=branch_dir, learning_rate=1e-3)
    sessions.append(branch)
    assert isinstance(branch, Session) and branch is not session
    assert branch.trainer.args.learning_rate == 1e-3 and branch.trainer.args.output_dir == str(branch_dir)
    assert finish(branch.start()) == "finished"
    assert starts.starts[-1] == 10
    btrainer = branch.trainer
    assert btrainer.state.global_step == 20
    assert {e["learning_rate"] for e in loss_logs(btrainer) if e["step"] > 10} == {1e-3}
    assert btrainer.get_learning_rates() == [1e-3] * len(btrainer.optimizer.param_groups)
    events = read_events(branch_dir)
    origin = [e for e in events if e["event"] == "branch"]
    assert len(origin) == 1
    assert origin[0]["checkpoint"] == str(ckpt.resolve())
    assert origin[0]["parent_output_dir"] == str(out.resolve())
    assert origin[0]["overrides"] == {"learning_rate": 1e-3}
    assert sorted(p.name for p in branch_dir.glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-20"]
    assert _tree(out) == before, "the branch wrote into the original output_dir"
    # The original session's model is its own: the branch trained a copy.
    assert session.model is not branch.model
    assert not all(torch.equal(a, b) for a, b in zip(session.model.parameters(), branch.model.parameters()))


# ------------------------------------------------------------------- 6. a training exception


class BoomError(RuntimeError):
    pass


class ExplodingMLP(MLPClassifier):
    """Raises in the forward of its third training step."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.train_calls = 0

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        if self.training:
            self.train_calls += 1
            if self.train_calls == 3:
                raise BoomError("the forward exploded at step 3")
        return super().forward(x, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)


def test_training_exception_surfaces_in_status_snapshot_wait_and_events(tmp_path, sessions):
    train, evals = mlp_data()
    torch.manual_seed(0)
    args = TrainingArguments(str(tmp_path), max_steps=10, per_device_train_batch_size=8, logging_steps=1,
                             report_to="none", disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=ExplodingMLP(), args=args, train_dataset=train, eval_dataset=evals)
    session = Session(trainer)
    sessions.append(session)
    q = session.subscribe()
    session.start()
    with pytest.raises(BoomError, match="exploded at step 3"):
        session.wait(TIMEOUT)
    assert not session._thread.is_alive()
    assert session.status == "failed"
    assert isinstance(session.error, BoomError)
    snap = session.snapshot()
    assert snap.status == "failed" and snap.error.startswith("BoomError") and "step 3" in snap.error
    assert snap.step == 2
    kinds = []
    while True:
        try:
            kinds.append(q.get(timeout=5))
        except queue.Empty:
            break
        if kinds[-1].kind == "failed":
            break
    failed = [e for e in kinds if e.kind == "failed"]
    assert len(failed) == 1 and "BoomError" in failed[0].data["error"]
    # events() on a failed run ends instead of blocking; the event log has the error.
    assert list(session.events()) == []
    assert [e["event"] for e in read_events(tmp_path)][-1] == "error"
    with pytest.raises(BoomError):  # and wait() keeps re-raising it
        session.wait(1)


# --------------------------------------------------------------------------- 7. host syncs


SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


class SyncCounter:
    """Counts host-sync calls made by the training thread between on_step_begin and
    on_step_end of steps that do not log (evaluation and saving are off)."""

    def __init__(self, monkeypatch) -> None:
        self.in_window = 0
        self.total = 0
        self.where: list[str] = []
        self.active = False
        self.thread: threading.Thread | None = None
        self.windows = 0
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        counter = self

        def wrapper(self, *args, **kwargs):
            if threading.current_thread() is counter.thread:
                counter.total += 1
                if counter.active:
                    counter.in_window += 1
                    import traceback

                    frame = traceback.extract_stack(limit=2)[0]
                    counter.where.append(f"{name} at {frame.filename}:{frame.lineno}")
            return original(self, *args, **kwargs)

        return wrapper

    def callbacks(self) -> tuple[TrainerCallback, TrainerCallback]:
        counter = self

        class Begin(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                counter.thread = threading.current_thread()

            def on_step_begin(self, args, state, control, **kwargs):
                nxt = state.global_step + 1
                logs = nxt % state.logging_steps == 0 or nxt >= state.max_steps or (nxt == 1 and args.logging_first_step)
                if not logs:
                    counter.active = True
                    counter.windows += 1

        class End(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                counter.active = False

        return Begin(), End()


def _sync_trainer(out, counter) -> tuple[Trainer, TrainerCallback]:
    begin, end = counter.callbacks()
    trainer = lm_trainer(out, max_steps=20, logging_steps=10, callbacks=[begin])
    return trainer, end


def test_no_host_syncs_on_non_logging_steps_trainer(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    trainer, end = _sync_trainer(tmp_path, counter)
    trainer.add_callback(end)
    trainer.train()
    assert trainer.state.global_step == 20
    assert counter.windows == 18  # steps 1-9 and 11-19
    assert counter.total > 0, "the counter saw nothing at all: the patch is not working"
    assert counter.in_window == 0, counter.where


def test_no_host_syncs_on_non_logging_steps_session_with_poller(tmp_path, monkeypatch, sessions):
    counter = SyncCounter(monkeypatch)
    trainer, end = _sync_trainer(tmp_path, counter)
    session = Session(trainer)
    sessions.append(session)
    # The window closes after the gates' step end: the Session's step-end work (its commands,
    # its publishing) is inside it.
    gates_step_end = trainer.gates.step_end

    def step_end_then_close(run) -> None:
        gates_step_end(run)
        end.on_step_end(run.args, run.state, run.control)

    trainer.gates.step_end = step_end_then_close
    polled: list[Snapshot] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            polled.append(session.snapshot())
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        assert finish(session.start()) == "finished"
    finally:
        done.set()
        poller.join(TIMEOUT)
    assert counter.windows == 18
    assert counter.total > 0
    assert counter.in_window == 0, counter.where
    assert polled and session.snapshot().status == "finished"
    assert session.snapshot().memory is not None  # sampled on a step end, inside the window


# ------------------------------------------------------------------------------ 8. memory


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)
    return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def test_memory_report_equals_summed_tensor_bytes(tmp_path, sessions):
    seen: list[tuple] = []

    class Measure(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step == 2:  # the third step: gradients present, optimizer state built
                params = list(model.parameters())
                expected = (_nbytes(params), _nbytes(p.grad for p in params if p.grad is not None),
                            _nbytes(_optimizer_tensors(optimizer)))
                seen.append((memory_report(model, optimizer), expected))

    trainer = lm_trainer(tmp_path, max_steps=200, callbacks=[Measure()])
    session = Session(trainer)
    sessions.append(session)
    session.start()
    wait_until(lambda: session.snapshot().memory is not None, "a memory figure in the snapshot")
    live = session.snapshot().memory
    wait_until(lambda: trainer.state.global_step >= 3, "the measured step")
    assert session.pause(wait=True, timeout=TIMEOUT) == "paused"
    now = session.memory()
    model = session.model
    params = list(model.parameters())
    # TinyGPT ties its LM head to the embedding: the tensor is counted once.
    assert now.parameters == _nbytes(params) == live.parameters
    assert now.parameters < _nbytes(t for _, t in model.state_dict().items())
    assert now.gradients == 0  # zero_grad(set_to_none=True) after each step
    assert now.optimizer_state == _nbytes(_optimizer_tensors(trainer.optimizer)) > 2 * now.parameters
    assert now.host_rss > 0 and now.host_peak >= now.host_rss and now.device_type == "cpu"
    session.stop(save=False)
    assert finish(session) == "stopped"

    (report, (params_b, grads_b, opt_b)), = seen
    assert report.parameters == params_b
    assert report.gradients == grads_b == params_b  # every parameter has a gradient of its size
    assert report.optimizer_state == opt_b > 0


def test_skip_memory_metrics_false_adds_stage_metrics(tmp_path, sessions):
    trainer = lm_trainer(tmp_path, max_steps=6, skip_memory_metrics=False)
    session = Session(trainer)
    sessions.append(session)
    assert finish(session.start()) == "finished"
    final = trainer.state.log_history[-1]
    for key in ("init_mem_cpu_alloc_delta", "init_mem_cpu_peaked_delta",
                "train_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta"):
        assert isinstance(final[key], int), key
    metrics = session.evaluate()  # finished: runs here and returns the metrics
    assert isinstance(metrics["eval_mem_cpu_alloc_delta"], int)
    assert isinstance(metrics["eval_mem_cpu_peaked_delta"], int)
    # with the default (skip) none of these appear
    other = lm_trainer(tmp_path / "skip", max_steps=2)
    other.train()
    assert not any("_mem_" in k for e in other.state.log_history for k in e)


# ----------------------------------------------------------------------------- 9. trackio


TRACKIO_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from workbench import Session, Trainer, TrainingArguments
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    out = sys.argv[1]
    train, _ = load_builtin_data("random-classification", n_train=256)
    torch.manual_seed(0)
    args = TrainingArguments(out, max_steps=12, per_device_train_batch_size=16, logging_steps=3,
                             report_to="trackio", project="wb-session-test", run_name="tiny-mlp",
                             learning_rate=1e-3, disable_tqdm=True, save_strategy="no")
    session = Session(Trainer(model=MLPClassifier(), args=args, train_dataset=train))
    assert session.start().wait(120) == "finished"

    import trackio
    from trackio.sqlite_storage import SQLiteStorage
    runs = trackio.Api().runs("wb-session-test")
    run = runs[0]
    print(json.dumps({
        "db": str(SQLiteStorage.get_project_db_path("wb-session-test")),
        "runs": [r.name for r in runs],
        "config": {k: run.config.get(k) for k in ("learning_rate", "max_steps", "project", "run_name")},
        "logs": [{k: v for k, v in e.items() if k != "timestamp"}
                 for e in SQLiteStorage.get_logs("wb-session-test", "tiny-mlp")],
        "history": session.trainer.state.log_history,
    }))
""")


def test_trackio_logs_land_in_a_local_project(tmp_path):
    # trackio reads TRACKIO_DIR once, when it is imported (trackio.utils.TRACKIO_DIR, copied
    # into its storage modules), so a fresh process with the variable set is the honest setup.
    store = tmp_path / "trackio"
    env = {**os.environ, "TRACKIO_DIR": str(store), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["db"]).parent == store and Path(result["db"]).is_file()
    assert result["runs"] == ["tiny-mlp"]
    assert result["config"] == {"learning_rate": 1e-3, "max_steps": 12, "project": "wb-session-test",
                                "run_name": "tiny-mlp"}
    logged = [(e["step"], e["loss"]) for e in result["logs"] if "loss" in e]
    expected = [(e["step"], e["loss"]) for e in result["history"] if "loss" in e]
    assert logged == expected and [s for s, _ in logged] == [3, 6, 9, 12]
    assert not (tmp_path / "hf" / "trackio").exists()


# ---------------------------------------------------------------------- 10. snapshot, events


def test_snapshot_is_immutable_and_complete_and_events_arrive(tmp_path, sessions):
    trainer = lm_trainer(tmp_path, max_steps=60, logging_steps=2, eval_strategy="steps", eval_steps=20,
                         eval_on_start=True, save_strategy="steps", save_steps=20)
    session = Session(trainer)
    sessions.append(session)
    assert session.snapshot() == Snapshot.empty() and session.status == "idle"
    kinds: list[str] = []
    subscribed = threading.Event()

    def consume() -> None:
        for event in session.events():
            kinds.append(event.kind)
            subscribed.set()

    session.start()
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert subscribed.wait(TIMEOUT), "no event arrived"
    live = []
    wait_until(lambda: (live.append(session.snapshot()) or live[-1].samples_per_second > 0), "throughput")
    assert session.pause(wait=True, timeout=TIMEOUT) == "paused"
    session.set(logging_steps=3)
    session.resume()
    assert isinstance(session.evaluate(), Future) and isinstance(session.save(), Future)
    assert finish(session) == "finished"
    consumer.join(TIMEOUT)
    assert not consumer.is_alive()
    for kind in ("logged", "evaluated", "saved", "paused", "resumed", "edited", "finished"):
        assert kind in kinds, f"no {kind!r} event in {sorted(set(kinds))}"
    assert kinds[-1] == "finished"
    logged = [e["event"] for e in read_events(tmp_path)]
    for event in ("start", "log", "eval", "save", "pause", "resume", "edit", "end"):
        assert event in logged, f"no {event!r} in events.jsonl"

    snap = session.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.status = "running"
    assert snap.status == "finished" and snap.step == 60 == snap.max_steps and snap.progress == 1.0
    assert snap.series["eval_loss"][0][0] == 0  # the eval_on_start point
    assert {0, 20, 40, 60} <= {s for s, _ in snap.series["eval_loss"]}
    for name in ("loss", "learning_rate", "grad_norm"):
        assert snap.series[name] and all(isinstance(v, float) for _, v in snap.series[name])
    assert snap.latest("loss") == loss_logs(trainer)[-1]["loss"]
    assert snap.edits[-1]["logging_steps"] == 3
    assert [c.name for c in snap.checkpoints][-1] == "checkpoint-60"
    assert snap.output_dir == str(tmp_path) and snap.device == "cpu" and snap.error is None
    running = [s for s in live if s.samples_per_second > 0]
    assert running and running[-1].eta is not None and running[-1].eta >= 0
    assert running[-1].steps_per_second > 0 and running[-1].tokens_per_second > 0
    assert running[-1].elapsed > 0 and 0 < running[-1].step < 60
    # an old snapshot is a still picture: later progress does not change it
    assert running[-1].status != "finished"


def test_series_store_stays_bounded_and_keeps_a_long_history():
    store = SeriesStore(limit=2000)
    n = 1_000_000
    for step in range(n):
        store.add("loss", step, 1.0 / (step + 1))
    store.add("loss", n, float("nan"))
    store.add("loss", n + 1, "text")  # ignored
    points = store.frozen()["loss"]
    assert len(points) <= 2000
    steps = [s for s, _ in points]
    assert steps[0] == 0 and steps[-2] == n - 1 and steps[-1] == n
    assert steps == sorted(set(steps))
    # coarse history across the whole run, detail at the end
    for decile in range(10):
        lo, hi = decile * n // 10, (decile + 1) * n // 10
        assert any(lo <= s < hi for s in steps), f"no point between steps {lo} and {hi}"
    assert steps[-100:] == list(range(n - 99, n + 1))
    assert isinstance(store.frozen()["loss"], tuple)


# ------------------------------------------------------------- 11. Ctrl-C while wait() blocks


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_keyboard_interrupt_in_wait_pauses_instead_of_killing(tmp_path, sessions):
    assert threading.current_thread() is threading.main_thread()
    trainer = lm_trainer(tmp_path, max_steps=100_000)
    session = Session(trainer)
    sessions.append(session)
    session.start()
    wait_until(lambda: trainer.state.global_step >= 3, "the first steps")
    sent = threading.Event()
    main = threading.main_thread()

    def main_thread_in_wait() -> bool:
        frame = sys._current_frames().get(main.ident)
        while frame is not None:
            if frame.f_code is Session.wait.__code__:
                return True
            frame = frame.f_back
        return False

    def interrupt() -> None:  # Ctrl-C, once the main thread blocks in wait() (never outside it)
        wait_until(main_thread_in_wait, "the main thread to block in wait()", every=0.01)
        time.sleep(0.1)
        signal.pthread_kill(main.ident, signal.SIGINT)
        sent.set()

    timer = threading.Thread(target=interrupt, daemon=True)
    timer.start()
    try:
        status = session.wait(TIMEOUT)  # returns when Ctrl-C arrives
    except KeyboardInterrupt:
        pytest.fail("wait() let the KeyboardInterrupt through instead of pausing the run")
    timer.join(TIMEOUT)
    assert sent.is_set()
    assert status in ("pausing", "paused")
    assert session._thread.is_alive(), "Ctrl-C killed the training thread"
    assert session.pause(wait=True, timeout=TIMEOUT) == "paused"
    step = trainer.state.global_step
    session.resume()
    session.set(max_steps=step + 3)
    assert finish(session) == "finished"
    assert trainer.state.global_step == step + 3


# ----------------------------------------------------------------- out-of-memory report


class OOMAtStep(torch.nn.Module):
    """A classifier that raises torch's real OutOfMemoryError on its 3rd training forward."""

    loss_type = "ForSequenceClassification"

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(32, 4)
        self.calls = 0

    def forward(self, x):  # no labels: the Trainer computes the default classification loss
        if self.training:
            self.calls += 1
            if self.calls == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        logits = self.net(x)
        return {"logits": logits}


def test_out_of_memory_writes_a_memory_report_before_the_error(tmp_path):
    from workbench import Trainer, TrainingArguments
    from workbench.data.builtin import load_builtin_data
    from workbench.core.event_file import read_events

    train, _ = load_builtin_data("random-classification", n_train=64)
    model = OOMAtStep()
    args = TrainingArguments(str(tmp_path), max_steps=5, per_device_train_batch_size=8, disable_tqdm=True,
                             save_strategy="no", report_to="none")
    trainer = Trainer(model=model, args=args, train_dataset=train)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    events = read_events(tmp_path)
    kinds = [e["event"] for e in events]
    assert kinds[-2:] == ["oom", "error"]
    oom = events[-2]
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert oom["parameters"] == expected and oom["step"] == 2
    assert oom["optimizer_state"] > 0 and oom["host_rss"] > 0
