"""The control endpoint from outside, end to end: ``workbench ctl`` and clients steering real
headless runs (``workbench run --headless`` subprocesses, one and two processes), through
preemption, resume_from, branch and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.control.client import Connection, attach
from workbench.control.discovery import CONTROL_FILE, read_control
from workbench.core.event_file import read_events
from workbench.door.protocol import Status

from support import REPO, Spawned, raw, restarted, wait_until, workbench
from support.headless import CTL_CONFIG, ctl_status, headless_run, stop_and_finish
from test_control_hostile import MALFORMED, WRONG, replies_until_closed  # the bad requests; reading a refusal

_TWO_RANK_SCRIPT = """
import json, sys, time
from workbench import Trainer, TrainingArguments, TrainerCallback
from workbench.data.builtin import load_builtin_data
from workbench.models.mlp import MLPClassifier

class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.01)

train, evals = load_builtin_data("random-classification", n_train=256, n_eval=32, in_features=8, num_classes=3, seed=1)
args = TrainingArguments(sys.argv[1], max_steps=100_000, per_device_train_batch_size=4, learning_rate=1e-2,
                         logging_steps=5, save_strategy="no", disable_tqdm=True, report_to="none", control=True)
trainer = Trainer(model=MLPClassifier(in_features=8, hidden=16, num_classes=3), args=args, train_dataset=train,
                  eval_dataset=evals, callbacks=[Slow()])
output = trainer.train()
rank = trainer.accelerator.process_index
lr = trainer.optimizer.param_groups[0]["lr"]
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"global_step": output.global_step,
               "lr_edits": [e.get("learning_rate") for e in trainer.workbench_state.live_edits]}, f)
# Leave together, as workbench run's ranks do (a rank tearing gloo down while the other still
# talks to it can abort at interpreter exit).
trainer.accelerator.wait_for_everyone()
import torch.distributed as dist
dist.destroy_process_group()
"""


def test_ctl_steers_a_headless_run(tmp_path):
    (tmp_path / "run.toml").write_text(CTL_CONFIG)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = Spawned([sys.executable, "-m", "workbench", "run", "run.toml", "--headless"], cwd=tmp_path, env=env,
                  logs=tmp_path / "logs")
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() or run.poll() is not None, "control.json", 120)
        assert run.poll() is None, run.communicate()
        status = workbench("ctl", out, "status", "--json", cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["status"] in ("running", "evaluating", "saving")
        paused = workbench("ctl", out, "pause", "--wait", cwd=tmp_path)
        assert paused.returncode == 0 and "paused" in paused.stdout
        bad = workbench("ctl", out, "set", "learning_rate=fast", cwd=tmp_path)
        assert bad.returncode == 2 and "learning_rate" in bad.stderr
        assert workbench("ctl", out, "launch", cwd=tmp_path).returncode == 2
        # For people: values as typed, not a dict's repr; a typo gets its fix named (issue 29).
        edited = workbench("ctl", out, "set", "learning_rate=1e-4", cwd=tmp_path)
        assert edited.returncode == 0, edited.stderr
        assert edited.stdout == "applied: learning_rate 1e-4\n"
        typo = workbench("ctl", out, "set", "learnig_rate=1e-4", cwd=tmp_path)
        assert typo.returncode == 2 and "(did you mean learning_rate?)" in typo.stderr
        mistyped = workbench("ctl", out, "stauts", cwd=tmp_path)
        assert mistyped.returncode == 2 and "(did you mean status?)" in mistyped.stderr
        for word in ("eval", "evaluate"):  # both names work
            evaluated = workbench("ctl", out, word, cwd=tmp_path)
            assert evaluated.returncode == 0 and evaluated.stdout.startswith("metrics: eval_loss "), evaluated
            assert "{" not in evaluated.stdout and "runtime" not in evaluated.stdout
        missing = workbench("ctl", out, "checkpoints", "delete", "checkpoint-999", cwd=tmp_path)
        assert missing.returncode == 2 and f"'workbench checkpoints {out}'" in missing.stderr
        assert "session.checkpoints" not in missing.stderr  # the CLI's command, not the Python API
        saved = workbench("ctl", out, "save", "--json", cwd=tmp_path)
        assert saved.returncode == 0, saved.stderr
        checkpoint = Path(json.loads(saved.stdout)["checkpoint"])
        assert (checkpoint / "manifest.json").is_file()
        assert workbench("ctl", out, "resume", cwd=tmp_path).returncode == 0
        stopped = workbench("ctl", out, "stop", cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr
    events = read_events(out)
    edits = [e for e in events if e["event"] == "edit"]
    assert edits and edits[-1]["learning_rate"] == 1e-4
    saves = [e["checkpoint"] for e in events if e["event"] == "save"]
    assert len(saves) == 2 and saves[0] == checkpoint.name  # the ctl save, then the stop's checkpoint
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "stopped"
    assert (end["stop_reason"], end["saved"], end["exit_code"]) == ("ctl", True, 0)
    assert not (out / CONTROL_FILE).exists()
    gone = workbench("ctl", out, "status", cwd=tmp_path)
    assert gone.returncode == 3 and "no live run" in gone.stderr
    stopped = f"stopped from workbench ctl at step {end['step']}"  # one wording (door/endings.py) everywhere
    assert f"the run {stopped}, checkpoint saved (exit code 0)" in gone.stderr
    assert f"workbench: {stopped}; checkpoint saved in {out}" in stderr
    # The run's own output told what ctl did, with the step (issue 29, item 3).
    told = [line for line in stderr.splitlines() if "from workbench ctl" in line]
    assert [line.split(" from ")[0].removeprefix("workbench: ") for line in told] == [
        "paused", "set learning_rate 1e-4", "evaluated", "evaluated", f"saved {checkpoint.name}", "resumed",
        "stopping", "stopped"], told
    assert all(" at step " in line for line in told if "saved checkpoint" not in line)
    watched = workbench("watch", out, cwd=tmp_path)  # not a terminal: plain lines, no escape codes
    assert watched.returncode == 0 and "\x1b" not in watched.stdout
    assert watched.stdout.splitlines()[0].startswith(f"ctl: {stopped}/"), watched.stdout


def test_a_client_tells_a_preempted_headless_run_and_follows_its_resume(tmp_path):
    """SIGTERM to a headless run: it exits 143 and the attached client says so (from the
    run's own record, the same code); the relaunch with --resume is followed."""
    import signal

    (tmp_path / "run.toml").write_text(CTL_CONFIG)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def launch(*extra: str) -> subprocess.Popen:
        run = Spawned([sys.executable, "-m", "workbench", "run", "run.toml", "--headless", *extra],
                      cwd=tmp_path, env=env, logs=tmp_path / "logs")
        wait_until(lambda: (out / CONTROL_FILE).exists() or run.poll() is not None, "control.json", 120)
        assert run.poll() is None, run.communicate()
        return run

    first = launch("--set", "training.enable_jit_checkpoint=true")  # SIGTERM: save, then exit 143
    runs = [first]
    try:
        remote = attach(out)
        wait_until(lambda: remote.snapshot().step >= 20, "some steps")
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
        assert first.returncode == 143
        assert remote.status == Status.STOPPED and remote.stop_reason == "SIGTERM"
        note = remote.end_note()
        assert note.startswith("the run stopped by SIGTERM at step") and note.endswith("(exit code 143)"), note
        gone = workbench("ctl", out, "status", cwd=tmp_path)
        assert gone.returncode == 3 and "exit code 143" in gone.stderr
        stopped_at = read_events(out)[-1]["step"]

        runs.append(launch("--resume"))
        wait_until(lambda: remote.snapshot().step > stopped_at, "the resumed run, through the same client", 120)
        assert remote.status in (Status.RUNNING, Status.SAVING, Status.EVALUATING)
        assert remote.stop(save=False) in (Status.STOPPING, Status.STOPPED)
        runs[1].communicate(timeout=120)
        assert runs[1].returncode == 130
        assert remote.end_note().endswith(", not saved (exit code 130)")

        runs.append(launch("--resume"))  # without enable_jit_checkpoint SIGTERM kills (as in HF)
        wait_until(lambda: remote.snapshot().status == Status.RUNNING, "the third run")
        runs[2].send_signal(signal.SIGTERM)
        runs[2].communicate(timeout=120)
        assert runs[2].returncode == -signal.SIGTERM
        assert remote.end_note().startswith(f"the run (pid {runs[2].pid}) is gone without recording how it ended")
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()


def test_a_run_too_busy_to_answer_in_time_is_slow_not_ended(tmp_path):
    """A run frozen past the client's timeout (SIGSTOP: what 2 busy cores or a long save look
    like from outside) stays running to the client, and once it truly ends the client tells
    how, from the run's own record: a late answer never turns into a made-up ending."""
    import signal

    (tmp_path / "run.toml").write_text(CTL_CONFIG)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = Spawned([sys.executable, "-m", "workbench", "run", "run.toml", "--headless",
                   "--set", "training.enable_jit_checkpoint=true"], cwd=tmp_path, env=env, logs=tmp_path / "logs")
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() or run.poll() is not None, "control.json", 120)
        remote = attach(out, timeout=0.5)
        wait_until(lambda: remote.snapshot().step >= 5, "some steps")
        seen = remote.snapshot()
        run.send_signal(signal.SIGSTOP)
        try:
            assert remote.snapshot() is seen  # timed out: the last snapshot, not an ending
            assert remote.status == Status.RUNNING and remote.stop_reason is None
            events, _ = remote.events_since(0)
            assert all(e.kind != "gone" for e in events)
        finally:
            run.send_signal(signal.SIGCONT)
        wait_until(lambda: remote.snapshot().step > seen.step, "training again after SIGCONT")
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=120)
        assert run.returncode == 143
        assert remote.status == Status.STOPPED and remote.stop_reason == "SIGTERM"
        assert remote.end_note().startswith("the run stopped by SIGTERM at step")
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGCONT)
            run.kill()


def test_malformed_requests_leave_nothing_on_the_runs_stderr(tmp_path):
    """The same lines against a ``workbench run`` subprocess: each an error reply, the run goes
    on, and its stderr holds no traceback (a 5,000-deep line once left a RecursionError there)."""
    out = tmp_path / "out"
    with headless_run(tmp_path) as run:
        info = read_control(out)
        for payload in MALFORMED:
            sock = raw(info)
            sock.sendall(payload + b"\n")
            replies = replies_until_closed(sock)
            assert len(replies) == 1 and replies[0]["ok"] is False, payload[:40]
            sock.close()
        conn = Connection(info)
        for request in WRONG:
            with pytest.raises(ValueError):
                conn.call(request["cmd"], **request.get("args", {}))
        before = conn.call("status")["step"]
        wait_until(lambda: conn.call("status")["step"] > before, "the run to keep stepping")
        conn.close()
        stopped = workbench("ctl", out, "stop", cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
        _, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr
    for word in ("Traceback", "RecursionError", "internal error", "Exception in thread"):
        assert word not in stderr, stderr


def test_ctl_resume_from_and_branch_keep_a_headless_run_going(tmp_path):
    import json

    out, branch_dir = tmp_path / "out", tmp_path / "low-lr"
    with headless_run(tmp_path) as run:
        wait_until(lambda: ctl_status(out, tmp_path)["step"] >= 10, "ten steps", every=0.2)
        assert workbench("ctl", out, "pause", "--wait", cwd=tmp_path).returncode == 0
        saved = workbench("ctl", out, "save", "--json", cwd=tmp_path)
        name = Path(json.loads(saved.stdout)["checkpoint"]).name
        step = int(name.split("-")[1])
        assert workbench("ctl", out, "resume", cwd=tmp_path).returncode == 0
        wait_until(lambda: ctl_status(out, tmp_path)["step"] > step + 20, "the run to go on", every=0.2)
        for bad in (("checkpoints", "resume_from", "checkpoint-999999"), ("checkpoints", "frobnicate"),
                    ("checkpoints", "resume_from", name, "output_dir=x"), ("checkpoints", "branch", name, "out")):
            refused = workbench("ctl", out, *bad, cwd=tmp_path)
            assert refused.returncode == 2 and refused.stderr.count("\n") == 1, (bad, refused.stderr)
        resumed = workbench("ctl", out, "checkpoints", "resume_from", name, "logging_steps=5", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert run.poll() is None  # the process restarted the run instead of exiting
        remote = attach(out)
        wait_until(lambda: restarted(remote), "the run to start again from the checkpoint")
        remote.close()
        branched = workbench("ctl", out, "checkpoints", "branch", name, "low-lr", "learning_rate=1e-3", "--json",
                             cwd=tmp_path)
        assert branched.returncode == 0, branched.stderr
        assert json.loads(branched.stdout)["output_dir"] == str(branch_dir)
        wait_until(lambda: not (out / CONTROL_FILE).exists(), "the parent's endpoint to close")
        assert run.poll() is None and ctl_status(branch_dir, tmp_path)["step"] >= step
        assert workbench("ctl", out, "status", cwd=tmp_path).returncode == 3
        stderr = stop_and_finish(run, branch_dir, tmp_path)
    assert str(branch_dir) in stderr, stderr
    parent = [e for e in read_events(out) if e["event"] == "end"]
    assert [e["status"] for e in parent] == ["stopped", "stopped"]  # the restarted run, then the branched one
    assert len(list(out.glob("checkpoint-*"))) == 2  # the ctl save, and the parent's save before the branch
    child = read_events(branch_dir)
    assert child[0]["event"] == "branch" and child[-1]["event"] == "end" and child[-1]["status"] == "stopped"
    assert any(branch_dir.glob("checkpoint-*"))  # ctl stop saves the branch


def test_ctrl_c_during_a_branch_stops_the_branch_with_a_checkpoint(tmp_path):
    """A branch that took over a headless ``workbench run`` is the run now: Ctrl-C stops it
    with a checkpoint in the branch's folder and exits 130, the parent's checkpoints untouched."""
    import json
    import signal

    out, branch_dir = tmp_path / "out", tmp_path / "low-lr"
    with headless_run(tmp_path) as run:
        wait_until(lambda: ctl_status(out, tmp_path)["step"] >= 10, "ten steps", every=0.2)
        saved = workbench("ctl", out, "save", "--json", cwd=tmp_path)
        name = Path(json.loads(saved.stdout)["checkpoint"]).name
        branched = workbench("ctl", out, "checkpoints", "branch", name, "low-lr", "learning_rate=1e-3", cwd=tmp_path)
        assert branched.returncode == 0, branched.stderr
        wait_until(lambda: (branch_dir / CONTROL_FILE).exists() and not (out / CONTROL_FILE).exists(),
                 "the branch to serve")
        start = ctl_status(branch_dir, tmp_path)["step"]
        wait_until(lambda: ctl_status(branch_dir, tmp_path)["step"] > start + 3, "the branch to train", every=0.2)
        parent_checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=180)
    assert run.returncode == 130, stderr
    end = read_events(branch_dir)[-1]
    assert (end["event"], end["stop_reason"], end["saved"]) == ("end", "SIGINT", True), end
    assert any(branch_dir.glob("checkpoint-*")) and not (branch_dir / CONTROL_FILE).exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == parent_checkpoints


def test_a_two_process_trainer_with_control_on_is_steered_from_rank_0(tmp_path):
    import json
    import os

    from workbench.checkpoint.store import CheckpointStore
    from workbench.distributed.launch import launcher_command

    script = tmp_path / "train.py"
    script.write_text(_TWO_RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    command, env = launcher_command(2, [str(script), str(out)])
    env = {**os.environ, **env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = Spawned(command, cwd=tmp_path, env=env, logs=tmp_path / "logs")
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() or run.poll() is not None, "control.json", 240)
        assert run.poll() is None, run.communicate()
        remote = attach(out)
        wait_until(lambda: remote.snapshot().step >= 5, "five steps", 120)
        assert remote.pause(wait=True, timeout=60) == Status.PAUSED
        step = remote.snapshot().step
        assert remote.set(learning_rate=3e-3, reason="two ranks").result(timeout=60) == {"learning_rate": 3e-3}
        path = remote.save().result(timeout=60)
        assert CheckpointStore(out).verify(path) == (True, None) and (path / "rng_state_1.pth").is_file()
        assert remote.resume() == Status.RUNNING
        wait_until(lambda: remote.snapshot().step > step + 5, "the ranks to go on", 120)
        remote.stop(save=False)
        _, stderr = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] > step  # both stopped at the same step
    assert ranks[0]["lr_edits"] == ranks[1]["lr_edits"] == [3e-3]  # the edit reached rank 1 too
    assert not (out / CONTROL_FILE).exists()
