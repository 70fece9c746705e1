"""What a Session reports while it trains: no host syncs on steps that do not log, memory
figures equal to the summed tensor bytes, trackio logs, immutable snapshots and their events,
Ctrl-C while ``wait()`` blocks, and an out-of-memory report written before the error.

Every test trains for real (TinyGPT or the small MLP) in the Session's worker thread; every
wait has a deadline and no assertion depends on timing.
"""

from __future__ import annotations

import dataclasses
import json
import os
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

from workbench import Session, TrainerCallback
from workbench.core.event_file import read_events
from workbench.data.builtin import load_builtin_data
from workbench.door.values import SeriesStore, Snapshot
from workbench.train.memory import memory_report

from support import DEADLINE, finish, wait_until
from support.lm import lm_trainer
from support.steering import loss_logs
from support.syncs import SyncCounter, sync_trainer

# --------------------------------------------------------------------------- 7. host syncs


def test_no_host_syncs_on_non_logging_steps_trainer(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    trainer, end = sync_trainer(tmp_path, counter)
    trainer.add_callback(end)
    trainer.train()
    assert trainer.state.global_step == 20
    assert counter.windows == 18  # steps 1-9 and 11-19
    assert counter.total > 0, "the counter saw nothing at all: the patch is not working"
    assert counter.in_window == 0, counter.where


def test_no_host_syncs_on_non_logging_steps_session_with_poller(tmp_path, monkeypatch, sessions):
    counter = SyncCounter(monkeypatch)
    trainer, end = sync_trainer(tmp_path, counter)
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
        poller.join(DEADLINE)
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
    assert session.pause(wait=True, timeout=DEADLINE) == "paused"
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
    assert subscribed.wait(DEADLINE), "no event arrived"
    live = []
    wait_until(lambda: (live.append(session.snapshot()) or live[-1].samples_per_second > 0), "throughput")
    assert session.pause(wait=True, timeout=DEADLINE) == "paused"
    session.set(logging_steps=3)
    session.resume()
    assert isinstance(session.evaluate(), Future) and isinstance(session.save(), Future)
    assert finish(session) == "finished"
    consumer.join(DEADLINE)
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
    assert running[-1].steps_per_second > 0
    # Non-padding tokens/s is known from the first log (a mask is read at logging points only).
    assert snap.tokens_per_second > 0 and all(s.tokens_per_second is None or s.tokens_per_second > 0 for s in live)
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
        status = session.wait(DEADLINE)  # returns when Ctrl-C arrives
    except KeyboardInterrupt:
        pytest.fail("wait() let the KeyboardInterrupt through instead of pausing the run")
    timer.join(DEADLINE)
    assert sent.is_set()
    assert status in ("pausing", "paused")
    assert session._thread.is_alive(), "Ctrl-C killed the training thread"
    assert session.pause(wait=True, timeout=DEADLINE) == "paused"
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


def test_out_of_memory_past_recovery_writes_a_memory_report_and_stops_with_a_checkpoint(tmp_path):
    from workbench import Health, Trainer, TrainingArguments
    from workbench.core.event_file import read_events

    train, _ = load_builtin_data("random-classification", n_train=64)
    model = OOMAtStep()
    args = TrainingArguments(str(tmp_path), max_steps=5, per_device_train_batch_size=8, disable_tqdm=True,
                             save_strategy="no", report_to="none")
    trainer = Trainer(model=model, args=args, train_dataset=train, health=Health(oom_retries=0))
    trainer.train()
    events = read_events(tmp_path)
    kinds = [e["event"] for e in events]
    assert kinds.index("oom") < kinds.index("save") and kinds[-1] == "end" and trainer.state.global_step == 2
    oom = events[kinds.index("oom")]
    assert "out of memory in forward again after 0 recoveries" in oom["reason"]
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert oom["parameters"] == expected and oom["step"] == 2
    assert oom["optimizer_state"] > 0 and oom["host_rss"] > 0
