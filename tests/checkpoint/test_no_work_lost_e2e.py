"""Nothing saved is lost or overwritten, end to end (issue 24, items 1-5): ``workbench`` run as a
user runs it, refusing a damaged --resume, a remote restart or branch with a bad target, a
closed terminal (SIGHUP) and a guard that can make no progress; test_no_work_lost.py checks the
same rules in process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.checkpoint.store import CheckpointStore
from workbench.core.event_file import read_events

from support import REPO, Slow, make_session, make_trainer, wait_until, workbench
from support.damage import flip_byte, tree_digest

VOCAB, SEQ = 40, 12
NO_CONTROL = {"WORKBENCH_CONTROL": "0"}  # the CLI runs here need no endpoint


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


def _logged_step(out: Path, step: int) -> bool:
    try:
        return any(e.get("event") == "log" and e.get("step", 0) >= step for e in read_events(out))
    except (OSError, ValueError):
        return False


def test_cli_resume_refuses_when_no_checkpoint_verifies_then_resumes_once_one_is_resealed(tmp_path):
    """The SLURM requeue path: ``workbench run --resume`` with every checkpoint damaged exits 2
    with one line and changes nothing (rotation would have deleted the older ones); once one
    is accepted with ``--reseal`` the same command resumes from it."""
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG, encoding="utf-8")
    first = workbench("run", config, "--headless", cwd=tmp_path, env=NO_CONTROL)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "out"
    for step in (2, 4, 6):
        flip_byte(out / f"checkpoint-{step}" / "model.safetensors")
    before = tree_digest(out)

    refused = workbench("run", config, "--headless", "--resume", cwd=tmp_path, env=NO_CONTROL)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith(f"workbench: --resume: no checkpoint in {out} verifies: checkpoint-6 "
                               "(model.safetensors does not match its sha256), checkpoint-4 "), lines[0]
    assert "--reseal NAME" in lines[0] and "--overwrite" in lines[0]
    assert tree_digest(out) == before

    resealed = workbench("checkpoints", out, "--reseal", "checkpoint-4", cwd=tmp_path, env=NO_CONTROL)
    assert resealed.returncode == 0, resealed.stderr
    resumed = workbench("run", config, "--headless", "--resume", cwd=tmp_path, env=NO_CONTROL)
    assert resumed.returncode == 0, resumed.stderr
    assert any(p.name.startswith("checkpoint-6.damaged-") for p in out.iterdir())
    assert CheckpointStore(out).verify(out / "checkpoint-6") == (True, None)
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6


def test_a_remote_restart_or_branch_with_a_bad_target_leaves_the_live_run_untouched(tmp_path, sessions):
    """Over a real socket: another run's checkpoint, one whose weights do not fit, a damaged
    one, and branches into ``/``, a file and a folder with things in it are each refused with
    one line while the run trains on, nothing saved and nothing written."""
    from workbench.control.client import attach
    from workbench.control.discovery import CONTROL_FILE
    from workbench.door.protocol import Status
    from workbench.models.mlp import MLPClassifier

    other = make_trainer(tmp_path / "other", max_steps=2, save_strategy="steps", save_steps=2)
    other.train()
    wider = make_trainer(tmp_path / "wider", max_steps=2, save_strategy="steps", save_steps=2)
    wider.model = MLPClassifier(in_features=8, hidden=32, num_classes=3)
    wider.train()

    out = tmp_path / "run"
    session = make_session(out, callbacks=[Slow()], save_strategy="steps", save_steps=5)
    sessions.append(session.start())
    wait_until(lambda: (out / CONTROL_FILE).exists() and session.snapshot().step >= 12, "two checkpoints")
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
        wait_until(lambda: session.snapshot().step > step, "the run to train on after a refusal")
        assert session.status == Status.RUNNING
    assert remote.check_branch("checkpoint-10", str(tmp_path / "b")) == {}  # a name resolves in the run's folder
    now = {p.name for p in out.glob("checkpoint-*")}
    assert set(saved) <= now and all(int(name.split("-")[1]) % 5 == 0 for name in now)  # scheduled saves only
    assert not (tmp_path / "b").exists() and a_file.read_text() == "mine\n"
    assert sorted(p.name for p in busy.iterdir()) == ["data.csv"]
    assert not {".lock", CONTROL_FILE, "events.jsonl"} & set(os.listdir("/"))
    assert damaged.parent.is_dir()  # the damaged checkpoint is still there, untouched by the refusals


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
        wait_until(lambda: _logged_step(out, 30), "the run to start", 120, every=0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    wait_until((tmp_path / "rc").exists, "the run to leave after its terminal closed", 60, every=0.2)
    assert (tmp_path / "rc").read_text().strip() == "129"
    end = read_events(out)[-1]
    assert (end["event"], end["stop_reason"], end["saved"], end["exit_code"]) == ("end", "SIGHUP", True, 129)
    assert not (out / ".lock").exists() and not (out / "control.json").exists()
    newest = CheckpointStore(out).latest_verified()
    assert newest is not None and newest.step == end["step"]
    resumed = workbench("run", config, "--headless", "--resume", "--set", f"training.max_steps={end['step'] + 5}",
                        cwd=tmp_path, env=NO_CONTROL)
    assert resumed.returncode == 0, resumed.stderr
    assert read_events(out)[-1]["step"] == end["step"] + 5


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
    result = workbench("run", config, "--headless", cwd=tmp_path, env=NO_CONTROL)
    assert time.monotonic() - started < 120
    assert result.returncode == 0, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    # logging_steps 2: each read finds two bad steps, and rolls back once for both
    assert last.startswith("workbench: stopped by the guard at step 0 after 10 interventions (no progress: 10 "
                           "interventions in a row without an accepted step (nonfinite, steps 1-2); guard events in "), last
    out = tmp_path / "out"
    assert CheckpointStore(out).latest_verified().step == 0
    assert read_events(out)[-1]["stop_reason"] == "guard"
