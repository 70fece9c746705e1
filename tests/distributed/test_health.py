"""Run health on one process (distributed/health.py, core/ledger.py): the time ledger adds up
to the wall time with evaluation, saves, a pause and a guard rollback; a step that stands still
for ``hang_timeout`` is reported with the phase it stands in and every thread's stack, and so is
a step end's callback, an evaluation batch and a save (a long evaluation that makes progress is
not); a hang clears once its rank moves and the next one is reported and dumped again; the
culprit rule on several ranks, and several ranks' watchdogs over a real store (a hang blamed
on the rank the others wait for, cleared, dumped again; each rank's work per step against the
others' median); the settings' checks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from workbench import ExportableState, Trainer, TrainerCallback, TrainingArguments
from workbench.core.ledger import CATEGORIES, Ledger, goodput_line
from workbench.core.args.training import ArgumentError
from workbench.data.builtin import load_builtin_data
from workbench.distributed.health import Health, HealthMonitor, culprit
from workbench.guard import Guard
from workbench.models import MLPClassifier
from workbench.widgets.view import describe_event, health_line, ranks_line

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
    # the stall is over a few steps before the end: cleared by the next look, or closed by the end record
    assert [kind for kind, _ in heard] in (["hang"], ["hang", "hang_cleared"])
    assert "hang" not in trainer.health_monitor.latest
    record = heard[0][1]
    assert record["rank"] == 0 and record["phase"] == "data" and record["stalled_step"] in (3, 4)
    stacks = (tmp_path / record["folder"].split("/")[-1] / "rank-0.txt").read_text()
    # every thread's stack, the stuck one in the collator's __call__ (this file)
    assert "phase data" in stacks and "test_health.py" in stacks and "in __call__" in stacks
    assert stacks.count("Thread 0x") + stacks.count("thread 0x") >= 2
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["rank"] for e in events if e["event"] == "hang"] == [0]


class Stalls(TrainerCallback, ExportableState):
    """Stands still for ``seconds`` where a run has no step progress to show: in a step end's
    callback (step 1, "other"), in one batch of the second evaluation, and in a save (this
    callback's state(), written into the checkpoint). The first evaluation is long but each
    of its batches is quick. Also the collator, so it knows when an evaluation draws a batch."""

    def __init__(self, ledger, seconds):
        self.ledger, self.seconds, self.evaluations, self.stood = ledger, seconds, 0, set()

    def _stand(self, where):
        if where not in self.stood:
            self.stood.add(where)
            time.sleep(self.seconds)

    def __call__(self, rows):
        if self.ledger.phase == "evaluation":
            if self.evaluations == 0:
                time.sleep(0.3)  # 8 batches: 2.4 s in all, over hang_timeout, but never standing still
            else:
                self._stand("evaluation")
        return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self._stand("other")

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1

    def state(self):
        self._stand("save")
        return {"args": {}, "attributes": {}}


def test_a_hang_in_a_callback_an_evaluation_or_a_save_is_reported_cleared_and_reported_again(tmp_path):
    train, evaluation = load_builtin_data("random-classification", n_train=256, n_eval=64, in_features=8,
                                          num_classes=3, seed=1)
    heard = []
    args = TrainingArguments(str(tmp_path), max_steps=6, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             eval_strategy="steps", eval_steps=3, save_steps=6, report_to="none", disable_tqdm=True,
                             dataloader_prefetch_factor=None)
    trainer = Trainer(model=MLPClassifier(in_features=8, hidden=8, num_classes=3), args=args, train_dataset=train,
                      eval_dataset=evaluation, health=Health(hang_timeout=1.0))
    stalls = Stalls(trainer.ledger, seconds=3.0)
    trainer.data_collator = stalls
    trainer.add_callback(stalls)
    trainer.health_listeners.append(lambda kind, record: heard.append((kind, record)))
    trainer.train()
    assert trainer.state.global_step == 6 and stalls.stood == {"other", "evaluation", "save"}
    # each hang clears once the run moves on; the save's, at the very end, is closed by the end record
    assert [(k, r["phase"], r["stalled_step"]) for k, r in heard] == [
        ("hang", "other", 1), ("hang_cleared", "other", 1), ("hang", "evaluation", 6),
        ("hang_cleared", "evaluation", 6), ("hang", "save", 6)], heard
    cleared = heard[1][1]
    assert cleared["at_step"] >= 1 and cleared["phase_now"] != "other" and 2.5 <= cleared["seconds"] <= 5.0
    assert describe_event("hang_cleared", 2, cleared)[1].startswith("hang over: rank 0 moved on from other at step 1")
    folders = [Path(r["folder"]) for k, r in heard if k == "hang"]
    assert len(set(folders)) == 3  # every hang dumps its stacks again, into a folder of its own
    stacks = [(folder / "rank-0.txt").read_text() for folder in folders]
    assert "in on_step_end" in stacks[0] and "in __call__" in stacks[1] and "in state" in stacks[2]
    assert "hang" not in trainer.health_monitor.latest  # the snapshot's red HANG line is gone
    assert not health_line(SimpleNamespace(health=trainer.health_monitor.latest)).startswith("HANG")
    # Found past the timeout, while it stood (each hang comes before its clearing, above); a beat
    # at the stall's very end, with the watchdog starved on a loaded machine, reads ~3 s.
    hangs = [r["seconds"] for k, r in heard if k == "hang"]
    assert all(1.0 <= seconds < 4.0 for seconds in hangs), hangs  # seconds are rounded to 0.1


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


def test_a_hang_outside_a_steps_phases_is_blamed_on_the_rank_the_others_wait_for():
    now = 100.0
    # rank 1 in a step end's callback, rank 0 waiting for it in the ranks' agreement
    assert culprit({0: _beat(6, "collective", 130), 1: _beat(6, "other", 131)}, now, 120)[0] == 1
    assert culprit({0: _beat(6, "collective", 130), 1: _beat(6, "save", 121)}, now, 120)[0] == 1
    # an evaluation: the rank standing at its batch longest (the other waits in a gather)
    assert culprit({0: _beat(9, "evaluation", 130), 1: _beat(9, "evaluation", 126)}, now, 120)[0] == 0
    # a rank waiting in DDP's all-reduce (backward) for one still in the step end's save
    assert culprit({0: _beat(9, "save", 200), 1: _beat(9, "backward", 190)}, now, 120)[0] == 0
    for phase in ("evaluation", "save", "other"):
        assert culprit({0: _beat(4, phase, 121)}, now, 120)[0] == 0
        assert culprit({0: _beat(4, phase, 119)}, now, 120) is None
    assert culprit({0: _beat(0, "startup", 900)}, now, 120) is None  # loading a large model is no hang
    # the rank the others wait for moves through long phases: slow, not stuck
    assert culprit({0: _beat(6, "collective", 130), 1: _beat(6, "other", 50)}, now, 120) is None
    # a rank whose train() ended is not silent, unless the others are left waiting for it (it failed)
    assert culprit({0: _beat(6, "other", 1), 1: _beat(6, "done", 1, age=300)}, now, 120) is None
    assert culprit({0: _beat(6, "collective", 130), 1: _beat(6, "done", 1, age=131)}, now, 120)[0] == 1


def _watchdogs(tmp_path, world, heard, **settings):
    """``world`` ranks' watchdogs over one real store, each rank's ledger on a clock of its own
    that the test moves: (clocks, ledgers, monitors, look)."""
    store, clocks = torch.distributed.HashStore(), [[0.0] for _ in range(world)]
    ledgers = [Ledger(clock=lambda clock=clock: clock[0]) for clock in clocks]
    monitors = [HealthMonitor(ledgers[r], Health(**settings), str(tmp_path), rank=r, world=world, store=store,
                              report=lambda kind, record: heard.append((kind, record))) for r in range(world)]

    def look(seconds=0.0):
        for clock in clocks:
            clock[0] += seconds
        for monitor in [*monitors[1:], monitors[0], *monitors[1:]]:  # beats in, rank 0 judges, the others dump
            monitor.tick()

    return clocks, ledgers, monitors, look


def test_two_ranks_clear_a_hang_and_dump_their_stacks_again_for_the_next(tmp_path):
    heard = []
    _, ledgers, monitors, look = _watchdogs(tmp_path, 2, heard, hang_timeout=2.0)
    for ledger in ledgers:
        ledger.step_done(6, 0.0)
    ledgers[0].enter("collective")  # rank 0 waits in the ranks' agreement ...
    ledgers[1].enter("other")  # ... for rank 1, in a step end's callback
    look(1.0)
    assert heard == []
    look(1.5)
    assert [(k, r["rank"], r["phase"], r["stalled_step"]) for k, r in heard] == [("hang", 1, "other", 6)]
    first = Path(heard[0][1]["folder"])
    assert sorted(p.name for p in first.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    look(3.0)  # still standing: one report, its seconds kept current
    assert len(heard) == 1 and monitors[0].latest["hang"]["seconds"] >= 5.0
    ledgers[1].enter("collective")  # rank 1 moves on; both go on to the next step
    for ledger in ledgers:
        ledger.enter("data")
    look(0.5)
    assert [k for k, _ in heard] == ["hang", "hang_cleared"] and "hang" not in monitors[0].latest
    assert heard[1][1]["rank"] == 1 and heard[1][1]["phase_now"] == "data"
    for ledger in ledgers:
        ledger.step_done(7, 0.0)
        ledger.enter("other")
    ledgers[0].enter("collective")
    ledgers[1].enter("save")  # the next hang: rank 1 in a save
    look(2.5)
    assert [(k, r["rank"], r["phase"]) for k, r in heard][2:] == [("hang", 1, "save")]
    second = Path(heard[2][1]["folder"])
    assert second != first and sorted(p.name for p in second.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert "step 7, phase save" in (second / "rank-1.txt").read_text()
    for monitor in monitors[::-1]:  # the run ends: the hang leaves the snapshot, no record after the end
        monitor.stop()
    assert "hang" not in monitors[0].latest and len(heard) == 3
    assert json.loads(monitors[0].store.get("workbench/health/hang"))["cleared"] is True


def test_each_ranks_work_per_step_is_published_against_the_others_median(tmp_path):
    heard = []
    clocks, ledgers, monitors, look = _watchdogs(tmp_path, 3, heard, hang_timeout=60.0)
    for step in (1, 2, 3):
        for rank, ledger in enumerate(ledgers):
            for phase in ("data", "forward", "optimizer", "backward"):  # rank 2 takes three times as long
                ledger.enter(phase)
                clocks[rank][0] += 0.03 if rank == 2 else 0.01
            ledger.step_done(step, 0.0)
        look()
    figures = monitors[0].latest["ranks"]
    ledgers_seen = {rank: figures[rank].pop("ledger") for rank in figures}
    assert figures["2"] == {"step": 3, "phase": "backward", "work_per_step": 0.09, "factor": 3.0}
    assert figures["0"]["work_per_step"] == figures["1"]["work_per_step"] == 0.03
    assert figures["0"]["factor"] == figures["1"]["factor"] == 0.5  # the others' median: (0.03 + 0.09) / 2
    # Each rank's own ledger reaches rank 0 with its beat: every second of its wall booked, three
    # quarters of it compute (forward, backward, optimizer) and a quarter waiting for data.
    for rank, seen in ledgers_seen.items():
        assert seen == ledgers[int(rank)].summary()
        assert seen["wall"] == pytest.approx(sum(v for k, v in seen.items() if k != "wall"), abs=1e-3)
        assert seen["compute"] == pytest.approx(3 * seen["data"], abs=1e-3) and seen["data"] > 0
    line = ranks_line({"ranks": {rank: {**figures[rank], "ledger": ledgers_seen[rank]} for rank in figures}})
    assert line == ("work a step by rank (x the others' median): 0 30.0 ms 0.50x goodput 75% · "
                    "1 30.0 ms 0.50x goodput 75% · 2 90.0 ms 3.00x goodput 75%")
    assert ranks_line({"ranks": {"0": figures["0"]}}) == "" and ranks_line(None) == ""
    assert heard == []


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
