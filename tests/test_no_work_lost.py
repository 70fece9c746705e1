"""Nothing saved is lost or overwritten (issue 24, items 1-5).

1. ``--resume`` when no checkpoint verifies refuses (exit 2, one line naming them) and touches
   nothing; a checkpoint that fails verification is never overwritten (a re-save of its step
   keeps it under another name) nor deleted by rotation.
2. and 3. A remote ``resume_from`` or ``branch`` is checked whole before anything stops: the
   checkpoint is this run's, complete, verified and fits the model; a branch's folder is new
   or empty.
4. SIGHUP (a closed terminal) takes SIGTERM's path: a checkpoint, an ``end`` record, exit 129.
5. A guard whose rollbacks or skips make no progress escalates instead of looping forever,
   and its events are bounded per minute.

The in-process tests check the rules; the slow ones run ``workbench`` as a user does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import make_args
from workbench import Trainer
from workbench.checkpoint.store import CheckpointStore
from workbench.data.builtin import TensorDictDataset
from workbench.models import TinyGPT

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 40, 12
_ids = torch.randint(0, VOCAB, (48, SEQ), generator=torch.Generator().manual_seed(0))
TRAIN = TensorDictDataset(input_ids=_ids, labels=_ids.clone())


def tiny(out, resume=None, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16, block_size=SEQ)
    options = dict(max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="steps",
                   save_steps=2, seed=1)
    options.update(overrides)
    trainer = Trainer(model=model, args=make_args(out, **options), train_dataset=TRAIN)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # the same size: only the hash tells
    path.write_bytes(bytes(data))


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its sha256: what "nothing changed" compares."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1. damaged checkpoints ------------------------------------------------------------------------


def test_resume_true_with_every_checkpoint_damaged_names_them_and_changes_nothing(tmp_path):
    out = tmp_path / "out"
    tiny(out)
    for step in (2, 4, 6):
        flip_byte(out / f"checkpoint-{step}" / "model.safetensors")
    before = tree_digest(out)
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory .*none verifies: "
                                         r"checkpoint-6 \(model.safetensors does not match its sha256\), "
                                         r"checkpoint-4 .*checkpoint-2 "):
        tiny(out, resume=True)
    assert tree_digest(out) == before


def test_a_resave_over_a_damaged_checkpoint_keeps_it_and_rotation_spares_damaged_ones(tmp_path, caplog):
    full = tiny(tmp_path / "full", max_steps=8)
    out = tmp_path / "out"
    tiny(out, max_steps=8, save_total_limit=10)
    damaged = out / "checkpoint-6" / "model.safetensors"
    flip_byte(damaged)
    kept = damaged.read_bytes()
    (out / "checkpoint-2" / "optimizer.pt").write_bytes(b"truncated")  # an old one, damaged by size
    (out / "checkpoint-8").rename(tmp_path / "gone-8")  # the newest good one is gone

    resumed = tiny(out, resume=True, max_steps=8, save_total_limit=2)  # from checkpoint-4, past the damaged 6
    aside = [p for p in out.iterdir() if p.name.startswith("checkpoint-6.damaged-")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").read_bytes() == kept
    assert "checkpoint-6 failed verification (model.safetensors does not match its sha256): kept as" in caplog.text
    store = CheckpointStore(out)
    # rotation to 2 deleted the sound checkpoint-4 and left the damaged checkpoint-2 alone
    assert [r.name for r in store.list()] == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
    assert store.problem(out / "checkpoint-2") is not None
    assert store.verify(out / "checkpoint-8") == (True, None)
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def workbench(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORKBENCH_CONTROL": "0"}
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


CONFIG = """\
[model]
builtin = "tiny-gpt"
options = { n_layer = 1, n_head = 2, n_embd = 32, block_size = 32 }
[data]
builtin = "python-source"
options = { block_size = 32, max_chars = 20000 }
[training]
output_dir = "out"
max_steps = 6
per_device_train_batch_size = 4
save_steps = 2
logging_steps = 2
report_to = "none"
seed = 3
"""


@pytest.mark.slow
def test_cli_resume_refuses_when_no_checkpoint_verifies_then_resumes_once_one_is_resealed(tmp_path):
    """The SLURM requeue path: ``workbench run --resume`` with every checkpoint damaged exits 2
    with one line and changes nothing (rotation would have deleted the older ones); once one
    is accepted with ``--reseal`` the same command resumes from it."""
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG, encoding="utf-8")
    first = workbench("run", config, "--headless", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "out"
    for step in (2, 4, 6):
        flip_byte(out / f"checkpoint-{step}" / "model.safetensors")
    before = tree_digest(out)

    refused = workbench("run", config, "--headless", "--resume", cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith(f"workbench: --resume: no checkpoint in {out} verifies: checkpoint-6 "
                               "(model.safetensors does not match its sha256), checkpoint-4 "), lines[0]
    assert "--reseal NAME" in lines[0] and "--overwrite" in lines[0]
    assert tree_digest(out) == before

    resealed = workbench("checkpoints", out, "--reseal", "checkpoint-4", cwd=tmp_path)
    assert resealed.returncode == 0, resealed.stderr
    resumed = workbench("run", config, "--headless", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert any(p.name.startswith("checkpoint-6.damaged-") for p in out.iterdir())
    assert CheckpointStore(out).verify(out / "checkpoint-6") == (True, None)
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6


# -- 2. and 3. remote restarts and branches, checked before anything stops -----------------------------


@pytest.mark.slow
def test_a_remote_restart_or_branch_with_a_bad_target_leaves_the_live_run_untouched(tmp_path, sessions):
    """Over a real socket: another run's checkpoint, one whose weights do not fit, a damaged
    one, and branches into ``/``, a file and a folder with things in it are each refused with
    one line while the run trains on, nothing saved and nothing written."""
    from test_session_door import Slow, make_session, make_trainer, wait_for  # the shared tiny real run
    from workbench.control.client import attach
    from workbench.control.discovery import CONTROL_FILE
    from workbench.models.mlp import MLPClassifier
    from workbench.door.protocol import Status

    other = make_trainer(tmp_path / "other", max_steps=2, save_strategy="steps", save_steps=2)
    other.train()
    wider = make_trainer(tmp_path / "wider", max_steps=2, save_strategy="steps", save_steps=2)
    wider.model = MLPClassifier(in_features=8, hidden=32, num_classes=3)
    wider.train()

    out = tmp_path / "run"
    session = make_session(out, callbacks=[Slow()], save_strategy="steps", save_steps=5)
    sessions.append(session.start())
    wait_for(lambda: (out / CONTROL_FILE).exists() and session.snapshot().step >= 12, "two checkpoints")
    # Each check reads and hashes a checkpoint: the endpoint's CPU budget paces this client's
    # requests, so it waits longer than a poll would.
    remote = attach(out, timeout=60)
    damaged = out / "checkpoint-5" / "model.safetensors"
    flip_byte(damaged)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "data.csv").write_text("a,b\n")
    saved = sorted(p.name for p in out.glob("checkpoint-*"))

    refusals = [
        (lambda: remote.resume_from(str(tmp_path / "other" / "checkpoint-2")), "is not a checkpoint of this run"),
        (lambda: remote.resume_from(str(tmp_path / "wider" / "checkpoint-2"), other_run=True),
         r"its weights do not fit this model \(.* is \[32, 8\] there, \[16, 8\] here\)"),
        (lambda: remote.resume_from("checkpoint-5"), "checkpoint-5 cannot be used: model.safetensors does not match"),
        (lambda: remote.branch("checkpoint-10", "/"), "/ is not empty"),
        (lambda: remote.branch("checkpoint-10", str(a_file)), "notes.txt is a file; a branch needs a new or empty"),
        (lambda: remote.branch("checkpoint-10", str(busy)), r"busy is not empty \(it holds data.csv\)"),
        (lambda: remote.branch(str(tmp_path / "other" / "checkpoint-2"), str(tmp_path / "b")),
         "is not a checkpoint of this run"),
        (lambda: remote.check_branch("checkpoint-5", str(tmp_path / "b")), "does not match its sha256"),
    ]
    for attempt, message in refusals:
        step = session.snapshot().step
        with pytest.raises(ValueError, match=message):
            attempt()
        wait_for(lambda: session.snapshot().step > step, "the run to train on after a refusal")
        assert session.status == Status.RUNNING
    assert remote.check_branch("checkpoint-10", str(tmp_path / "b")) == {}  # a name resolves in the run's folder
    now = {p.name for p in out.glob("checkpoint-*")}
    assert set(saved) <= now and all(int(name.split("-")[1]) % 5 == 0 for name in now)  # scheduled saves only
    assert not (tmp_path / "b").exists() and a_file.read_text() == "mine\n"
    assert sorted(p.name for p in busy.iterdir()) == ["data.csv"]
    assert not {".lock", CONTROL_FILE, "events.jsonl"} & set(os.listdir("/"))
    assert damaged.parent.is_dir()  # the damaged checkpoint is still there, untouched by the refusals


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def sessions():
    """Sessions a test started: stopped, waited for and closed at the end."""
    made = []
    yield made
    for s in made:
        s.stop(save=False)
        try:
            s.wait(60)
        finally:
            s.close()


# -- 4. a closed terminal ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
@pytest.mark.parametrize("how", ["dashboard", "dashboard-not-signalled", "headless"])
def test_closing_the_terminal_stops_with_a_checkpoint_an_end_record_and_129(tmp_path, how):
    """``tmux kill-session`` closes the run's terminal. The run saves a checkpoint, writes its
    ``end`` record (stop_reason SIGHUP) and exits 129, leaving no ``.lock`` or ``control.json``.
    "dashboard-not-signalled": the run is in a session of its own (``setsid``), so only its
    parent gets the SIGHUP: the dashboard notices its terminal is gone and does the same
    instead of spinning on it. The checkpoint then resumes."""
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG.replace("max_steps = 6", "max_steps = 100000").replace("save_steps = 2",
                                                                                     "save_steps = 100000"))
    command = [sys.executable, "-m", "workbench.cli", "run", str(config)] + (["--headless"] if how == "headless" else [])
    if how == "dashboard-not-signalled":
        command = ["setsid", "-w", *command]
    script = tmp_path / "run.sh"
    # The wrapper ignores the hang-up so it can record the exit code; the run itself does not
    # inherit that (Python installs its own handler).
    script.write_text(f"#!/bin/sh\ntrap '' HUP\ncd {tmp_path}\nexport PYTHONPATH={REPO} OMP_NUM_THREADS=1\n"
                      f"{' '.join(map(str, command))}\necho $? > {tmp_path / 'rc'}\n")
    script.chmod(0o755)
    name = f"hup-{os.getpid()}-{how}"
    out = tmp_path / "out"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "36", str(script)], check=True)
    try:
        deadline = time.monotonic() + 120
        while not _logged_step(out, 30):
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "rc").exists():
        assert time.monotonic() < deadline, "the run did not leave after its terminal closed"
        time.sleep(0.2)
    assert (tmp_path / "rc").read_text().strip() == "129"
    end = json_lines(out / "events.jsonl")[-1]
    assert (end["event"], end["stop_reason"], end["saved"], end["exit_code"]) == ("end", "SIGHUP", True, 129)
    assert not (out / ".lock").exists() and not (out / "control.json").exists()
    newest = CheckpointStore(out).latest_verified()
    assert newest is not None and newest.step == end["step"]
    resumed = workbench("run", config, "--headless", "--resume", "--set", f"training.max_steps={end['step'] + 5}",
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json_lines(out / "events.jsonl")[-1]["step"] == end["step"] + 5


def _logged_step(out: Path, step: int) -> bool:
    try:
        return any(e.get("event") == "log" and e.get("step", 0) >= step for e in json_lines(out / "events.jsonl"))
    except (OSError, ValueError):
        return False


# -- 5. a guard that makes no progress -----------------------------------------------------------------


@pytest.mark.parametrize("action", ["rollback", "skip"])
def test_a_guard_getting_nowhere_stops_a_headless_run_with_a_checkpoint(tmp_path, action):
    """Every step non-finite: rollbacks go back to the same snapshot, skips accept nothing.
    After ``max_no_progress`` the run stops with a checkpoint of finite weights, and the
    record says why; it used to roll back forever (epoch 155 after 5 minutes)."""
    from test_guard import N, Poisoned, run, weights as guard_weights
    from workbench import Guard
    from workbench.core.event_file import read_events

    guard = Guard(nonfinite=action, snapshot_every=4, max_no_progress=3)
    trainer, order = run(tmp_path / "run", Poisoned(nan_ids=range(N)), guard, max_steps=10_000, logging_steps=1)
    assert len(order.steps) <= 6  # three bad steps, then the stop (a rollback repeats the restored step)
    saved = trainer.workbench_state.guard
    expected = ("3 rollbacks to step 0 without getting past it" if action == "rollback" else
                "3 interventions in a row without an accepted step (nonfinite, steps 1-3)")
    assert saved["progress"]["escalated"] == expected
    events = read_events(tmp_path / "run")
    assert [e["reason"] for e in events if e["event"] == "guard_escalated"] == [expected]
    end = events[-1]
    assert (end["event"], end["stop_reason"], end["saved"]) == ("end", "guard", True)
    assert CheckpointStore(tmp_path / "run").latest_verified().step == trainer.state.global_step
    assert all(torch.isfinite(w).all() for w in guard_weights(trainer))


def test_an_interactive_run_pauses_and_gets_as_many_tries_again(tmp_path):
    from test_guard import N, BATCH, Poisoned, Regression
    from workbench import Guard, Session
    from workbench.door.protocol import Status

    trainer = Trainer(model=Regression(), train_dataset=Poisoned(nan_ids=range(N)),
                      args=make_args(tmp_path / "s", max_steps=100, per_device_train_batch_size=BATCH, seed=3))
    session = Session(trainer, guard=Guard(nonfinite="skip", max_no_progress=4), control=False)
    try:
        session.start()
        deadline = time.monotonic() + 60
        while session.status != Status.PAUSED:
            assert time.monotonic() < deadline and session.status not in (Status.FINISHED, Status.FAILED)
            time.sleep(0.01)
        assert session.snapshot().step == 4
        session.resume()
        while session.snapshot().step < 8 or session.status != Status.PAUSED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert session.snapshot().step == 8
    finally:
        session.stop(save=False)
        session.resume()
        session.wait(60)
        session.close()


def test_guard_events_are_bounded_per_minute_with_a_summary(tmp_path):
    """200 bad steps within a minute: 60 ``guard`` lines, then one ``guard_summary`` with the
    rest counted; every intervention stays in workbench_state."""
    from test_guard import N, Poisoned, run
    from workbench import Guard
    from workbench.core.event_file import read_events

    trainer, _ = run(tmp_path / "run", Poisoned(nan_ids=range(N)), Guard(nonfinite="skip", max_no_progress=None),
                     max_steps=200, logging_steps=50)
    events = read_events(tmp_path / "run")
    guard_lines = [e for e in events if e["event"] == "guard"]
    summaries = [e for e in events if e["event"] == "guard_summary"]
    assert len(guard_lines) == 60 and [e["step"] for e in guard_lines] == list(range(1, 61))
    assert len(summaries) == 1
    assert summaries[0]["count"] == 140 and summaries[0]["left_out"] == {"nonfinite": 140}
    assert summaries[0]["steps"] == [61, 200]
    assert len(trainer.workbench_state.guard["interventions"]) == 200


@pytest.mark.slow
def test_cli_run_whose_every_step_is_nan_under_rollback_ends_with_one_line(tmp_path):
    """``workbench run --headless`` with ``nonfinite = "rollback"`` and a loss that is always
    NaN: it stops (exit 0, the guard's stop) with a checkpoint and one line saying why, in
    seconds, instead of rolling back to the same snapshot forever."""
    (tmp_path / "nan_loss.py").write_text(
        "def loss(outputs, labels, num_items_in_batch=None):\n"
        "    return outputs['logits'].float().sum() * float('nan')\n")
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG.replace("max_steps = 6", "max_steps = 100000")
                      + '[hooks]\ncompute_loss_func = "nan_loss:loss"\n'
                      + '[guard]\nnonfinite = "rollback"\nsnapshot_every = 5\n')
    started = time.monotonic()
    result = workbench("run", config, "--headless", cwd=tmp_path)
    assert time.monotonic() - started < 120
    assert result.returncode == 0, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    # logging_steps 2: each read finds two bad steps, and rolls back once for both
    assert last.startswith("workbench: stopped by the guard at step 0 after 10 interventions (no progress: 10 "
                           "interventions in a row without an accepted step (nonfinite, steps 1-2); guard events in "), last
    out = tmp_path / "out"
    assert CheckpointStore(out).latest_verified().step == 0
    assert json_lines(out / "events.jsonl")[-1]["stop_reason"] == "guard"


def test_a_terminal_is_gone_once_its_other_end_closes_and_nothing_else_ever_is(tmp_path):
    import pty

    from workbench.cli.hangup import terminal_gone

    master, slave = pty.openpty()
    try:
        assert not terminal_gone(slave)
        os.close(master)
        assert terminal_gone(slave)  # still a character device, no longer a tty: reads end, writes fail
    finally:
        os.close(slave)
    with open(tmp_path / "log.txt", "w") as f, open(os.devnull, "w") as null:
        assert not terminal_gone(f.fileno()) and not terminal_gone(null.fileno())
    read_end, write_end = os.pipe()
    assert not terminal_gone(write_end)
    os.close(read_end), os.close(write_end)
