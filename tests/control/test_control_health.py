"""Run health over the protocol: an attached client's snapshot and ``ctl status`` carry the
time ledger, and a hang the watchdog finds reaches an attached client as an event while the
training thread is stuck, and leaves the snapshot once the step moves on; ``watch`` of the
finished run reads the hang and the end record's ledger from events.jsonl."""

from __future__ import annotations



from workbench import Session, Trainer, TrainingArguments
from workbench.cli import main
from workbench.control.client import attach
from workbench.control.watch import open_watch
from workbench.data.builtin import load_builtin_data
from workbench.distributed.health import Health
from workbench.door.protocol import Status
from workbench.models import MLPClassifier

from support import DEADLINE, wait_until
from support.stalls import StuckOnce


def test_attach_and_ctl_status_carry_the_ledger_and_a_hang(tmp_path, sessions, capsys):
    out = tmp_path / "run"
    train, _ = load_builtin_data("random-classification", n_train=512, n_eval=8, in_features=8, num_classes=3, seed=1)
    args = TrainingArguments(str(out), max_steps=30, per_device_train_batch_size=8, report_to="jsonl",
                             disable_tqdm=True, save_strategy="no", logging_steps=5)
    trainer = Trainer(model=MLPClassifier(in_features=8, hidden=8, num_classes=3), args=args, train_dataset=train,
                      data_collator=StuckOnce(at=12, seconds=6.0), health=Health(hang_timeout=1.5))
    session = Session(trainer)
    sessions.append(session.start())
    wait_until(lambda: (out / "control.json").exists(), "the endpoint", DEADLINE)
    remote = attach(out)
    hang = wait_until(lambda: next((e for e in remote.events_since(0)[0] if e.kind == "hang"), None),
                      "the hang over attach", DEADLINE)
    assert hang.data["rank"] == 0 and hang.data["phase"] == "data"
    status = remote._call("status")
    assert status["health"]["hang"]["phase"] == "data" and status["health"]["ledger"]["wall"] > 0
    assert main(["ctl", str(out), "status"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("{")]  # the run's logs apart
    assert any(line.startswith("HANG: rank 0 in data at step") and "goodput" in line for line in printed), printed
    assert session.wait(timeout=DEADLINE) == Status.FINISHED
    wait_until(lambda: remote.snapshot().health and remote.snapshot().health["ledger"]["data"] >= 5.5,
               "the ledger over attach", DEADLINE)
    assert remote.snapshot().health["hang"] is None  # the step moved on: the red HANG line is gone
    remote.close()
    session.close()
    recorded = open_watch(out)
    kinds = [e.kind for e in recorded.events_since(0)[0]]
    assert "hang" in kinds and kinds[-1] == "finished"
    health = recorded.snapshot().health  # watch of the finished run: the end record's ledger
    assert health["ledger"]["data"] >= 5.5 and health["throughput"]["train_samples_per_second"] > 0


def test_watch_drops_a_hang_once_a_hang_cleared_record_follows_it(tmp_path):
    from workbench.core.event_file import EventFile

    events = EventFile(tmp_path)
    events.write("start", 0, max_steps=10)
    hang = {"rank": 1, "phase": "save", "stalled_step": 4, "seconds": 130.0, "silent": False, "folder": "hang-x"}
    events.write("hang", 4, **hang)
    assert open_watch(tmp_path).snapshot().health["hang"]["phase"] == "save"  # a run killed while it stood
    events.write("hang_cleared", 4, rank=1, phase="save", stalled_step=4, at_step=4, phase_now="other", seconds=140.0,
                 folder="hang-x")
    recorded = open_watch(tmp_path)
    assert "hang" not in (recorded.snapshot().health or {})
    assert [e.kind for e in recorded.events_since(0)[0]] == ["started", "hang", "hang_cleared"]
