"""Run health on one process (distributed/health.py, core/ledger.py): the time ledger adds up
to the wall time with evaluation, saves, a pause and a guard rollback; a step that stands still
for ``hang_timeout`` is reported with the phase it stands in and every thread's stack; the
culprit rule on several ranks; the settings' checks."""

from __future__ import annotations

import json
import time

import pytest

from workbench import Trainer, TrainingArguments
from workbench.core.ledger import CATEGORIES, Ledger, goodput_line
from workbench.core.args.training import ArgumentError
from workbench.data.builtin import load_builtin_data
from workbench.distributed.health import Health, HealthMonitor, culprit
from workbench.guard import Guard
from workbench.models import MLPClassifier

from support.guarded import Poisoned, Regression
from support.steering import PauseAt
from support.stalls import StuckOnce
from support.waiting import wait_until


def test_the_ledger_books_every_second_to_one_category():
    now = [0.0]
    ledger = Ledger(clock=lambda: now[0])
    for phase, seconds in (("data", 1.0), ("forward", 2.0), ("backward", 3.0), ("optimizer", 1.0), ("other", 0.5)):
        ledger.enter(phase)
        now[0] += seconds
    with ledger.during("save"):
        now[0] += 0.5
    ledger.step_done(1, 6.0)
    ledger.undo_steps(0)
    summary = ledger.summary()
    assert set(summary) == {*CATEGORIES, "wall"} and summary["wall"] == 8.0
    assert summary["rolled_back"] == 6.0 and summary["compute"] == 0.0 and summary["save"] == 0.5
    assert sum(v for k, v in summary.items() if k != "wall") == pytest.approx(8.0)
    assert goodput_line({"compute": 93, "data": 4, "evaluation": 2, "save": 1, "wall": 100}) == \
        "goodput 93%: data 4%, eval 2%, save 1%"


def test_a_run_with_evaluation_saves_a_pause_and_a_rollback_adds_up_to_its_wall_time(tmp_path, sessions):
    from workbench import Session

    started = time.perf_counter()
    args = TrainingArguments(str(tmp_path), max_steps=40, per_device_train_batch_size=8, learning_rate=0.05,
                             eval_strategy="steps", eval_steps=10, save_steps=10, logging_steps=5, report_to="none",
                             disable_tqdm=True, seed=3)
    pause = PauseAt(12)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Poisoned(spike_ids=[50]), callbacks=[pause],
                      eval_dataset=Poisoned(), guard=Guard(spike="rollback", window=5, snapshot_every=5))
    session = pause.session = Session(trainer)
    sessions.append(session)
    session.start()
    wait_until(lambda: session.snapshot().status.value == "paused", "the pause", timeout=60)
    time.sleep(0.5)
    session.resume()
    session.wait(60)
    wall = time.perf_counter() - started
    summary = trainer.ledger.summary()
    assert sum(v for k, v in summary.items() if k != "wall") == pytest.approx(summary["wall"], abs=1e-3)  # rounded to 0.1 ms
    assert summary["wall"] == pytest.approx(wall, rel=0.02, abs=0.1)  # the ledger starts with the Trainer
    assert summary["paused"] >= 0.45 and summary["evaluation"] > 0 and summary["save"] > 0
    assert summary["rolled_back"] > 0 and summary["compute"] > 0 and summary["data"] > 0
    health = session.snapshot().health
    assert health["ledger"]["paused"] >= 0.45 and "goodput" in goodput_line(health["ledger"])
    end = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["time_ledger"]["paused"] >= 0.45


def test_a_step_standing_still_is_reported_with_its_phase_and_stacks(tmp_path):
    train, _ = load_builtin_data("random-classification", n_train=256, n_eval=8, in_features=8, num_classes=3, seed=1)
    heard = []
    args = TrainingArguments(str(tmp_path), max_steps=8, per_device_train_batch_size=8, report_to="none",
                             disable_tqdm=True, save_strategy="no", dataloader_prefetch_factor=None)
    trainer = Trainer(model=MLPClassifier(in_features=8, hidden=8, num_classes=3), args=args, train_dataset=train,
                      data_collator=StuckOnce(at=5, seconds=3.0), health=Health(hang_timeout=1.0))
    trainer.health_listeners.append(lambda kind, record: heard.append((kind, record)))
    trainer.train()  # hang_action = "report": the run waits the stall out and finishes
    assert trainer.state.global_step == 8
    assert [kind for kind, _ in heard] == ["hang"]
    record = heard[0][1]
    assert record["rank"] == 0 and record["phase"] == "data" and record["stalled_step"] in (3, 4)
    stacks = (tmp_path / record["folder"].split("/")[-1] / "rank-0.txt").read_text()
    # every thread's stack, the stuck one in the collator's __call__ (this file)
    assert "phase data" in stacks and "test_health.py" in stacks and "in __call__" in stacks
    assert stacks.count("Thread 0x") + stacks.count("thread 0x") >= 2
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["rank"] for e in events if e["event"] == "hang"] == [0]


def _beat(step, phase, in_phase, age=0.0, now=100.0):
    return {"step": step, "phase": phase, "in_phase": in_phase, "time": now - age}


def test_the_culprit_is_the_rank_the_others_wait_for():
    now = 100.0
    data_stuck = {0: _beat(12, "backward", 130), 1: _beat(12, "data", 131)}
    assert culprit(data_stuck, now, 120)[0] == 1
    before_collective = {0: _beat(12, "collective", 130), 1: _beat(11, "optimizer", 129)}
    assert culprit(before_collective, now, 120)[0] == 1
    silent = {0: _beat(12, "backward", 130), 1: _beat(12, "forward", 1, age=200)}
    assert culprit(silent, now, 120)[0] == 1
    assert culprit({0: _beat(12, "forward", 5), 1: _beat(12, "data", 3)}, now, 120) is None
    assert culprit({0: _beat(3, "paused", 900)}, now, 120) is None  # a pause is not a hang


def test_stragglers_are_named_after_they_stay_slow(tmp_path):
    reports = []
    monitor = HealthMonitor(Ledger(), Health(straggler_factor=2.0, straggler_after=2.0), str(tmp_path), world=3,
                            report=lambda kind, record: reports.append((kind, record)))
    for now in (10.0, 11.0, 12.5):
        monitor.beats = {r: {"step": 5, "phase": "forward", "in_phase": 0.1, "time": now, "work": w}
                         for r, w in ((0, 0.1), (1, 0.11), (2, 0.35))}
        monitor._judge(now)
    assert [(k, r["rank"]) for k, r in reports] == [("straggler", 2)]
    assert reports[0][1]["factor"] == pytest.approx(0.35 / 0.105, rel=0.01)


@pytest.mark.parametrize("field, value, message", [
    ("hang_timeout", -1, "expected a number >= 0"),
    ("hang_action", "kill", 'expected "report" or "stop"'),
    ("straggler_factor", 1.0, "expected a number > 1"),
    ("oom_retries", 1.5, "expected a whole number >= 0"),
])
def test_health_settings_are_checked_naming_the_field(field, value, message):
    with pytest.raises(ArgumentError) as caught:
        Health(**{field: value})
    assert caught.value.key == field and message in str(caught.value)
