"""Attach to any run, end to end (issue 17): real ``workbench run --headless`` subprocesses
steered from a real terminal (``workbench attach`` in tmux), from a notebook kernel
(nbclient), over TCP with a token typed on the command line, and across two ranks with
``workbench ctl``. Every wait is for a condition, with a generous deadline; the only
timing checks are "the step did not move while paused"."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from workbench.checkpoint.store import CheckpointStore
from workbench.control.discovery import CONTROL_FILE, read_control
from workbench.core.event_file import read_events
from workbench.door.protocol import Status

from support import REPO, Spawned, poll_until, running, subprocess_env, wait_until, workbench
from support.headless import CTL_CONFIG, ctl_status, headless_run, stop_and_finish
from support.notebooks import run_notebook, text_of

# -- a real terminal ---------------------------------------------------------------------------------


def _capture(name: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout


def _keys(name: str, *keys: str) -> None:
    subprocess.run(["tmux", "send-keys", "-t", name, *keys], check=True)


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_attach_in_a_real_terminal_steers_a_headless_run(tmp_path):
    out = tmp_path / "out"
    code = tmp_path / "attach-exit-code"
    name = f"wb-attach-{tmp_path.name}"[:40]
    exe = Path(sys.executable).with_name("workbench")
    with headless_run(tmp_path) as run:
        command = f"cd {tmp_path} && OMP_NUM_THREADS=1 {exe} attach {out}; echo $? > {code}"
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "110", "-y", "32", command], check=True)
        try:
            def screen_shows(condition: Callable[[str], bool], what: str) -> str:
                def check() -> str | None:
                    screen = _capture(name)
                    assert not code.exists(), f"the attached dashboard exited while waiting for {what}:\n{screen}"
                    return screen if condition(screen) else None

                return wait_until(check, f"{what}; the screen:\n{_capture(name)}", 120, 0.3)

            screen_shows(lambda s: "RUNNING" in s and re.search(r"step \d+/100000", s), "the attached dashboard")

            # space: the run pauses; the attached screen says so and the run's step stops moving.
            _keys(name, "space")
            screen_shows(lambda s: "PAUSED" in s, "the PAUSED badge")
            paused = wait_until(lambda: (s := ctl_status(out, tmp_path))["status"] == "paused" and s, "paused", every=0.2)
            time.sleep(1.0)
            assert ctl_status(out, tmp_path)["step"] == paused["step"], "the step moved while paused"
            step = paused["step"]

            # l: the edit form; the learning rate field has the focus.
            _keys(name, "l")
            screen_shows(lambda s: "Change hyperparameters" in s, "the edit form")
            _keys(name, "1e-4", "Enter")
            wait_until(lambda: [e for e in read_events(out) if e["event"] == "edit"], "an edit event in events.jsonl")
            edit = [e for e in read_events(out) if e["event"] == "edit"][-1]
            assert edit["learning_rate"] == 1e-4 and edit["step"] == step

            # s: a checkpoint at the paused step.
            screen_shows(lambda s: "Change hyperparameters" not in s, "the edit form to close")
            _keys(name, "s")
            checkpoint = out / f"checkpoint-{step}"
            wait_until(lambda: CheckpointStore(out).verify(checkpoint) == (True, None), f"{checkpoint.name}", 120)

            # space again, then q (Detach has the focus): the dashboard exits 0, the run goes on.
            _keys(name, "space")
            wait_until(lambda: ctl_status(out, tmp_path)["step"] > step, "the run to resume", every=0.2)
            _keys(name, "q")
            screen_shows(lambda s: "Detach" in s, "the quit dialog")
            _keys(name, "Enter")
            wait_until(code.exists, "the attached dashboard to exit", 60)
            assert code.read_text().strip() == "0"
        finally:
            subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        moving = ctl_status(out, tmp_path)
        assert moving["status"] == "running" and run.poll() is None
        wait_until(lambda: ctl_status(out, tmp_path)["step"] > moving["step"], "the run to go on after detaching", every=0.2)
        stop_and_finish(run, out, tmp_path)
    events = read_events(out)
    saves = [e["checkpoint"] for e in events if e["event"] == "save"]
    assert saves[0] == f"checkpoint-{step}" and len(saves) == 2  # the s key's, then the stop's
    assert CheckpointStore(out).verify(out / saves[-1]) == (True, None)
    assert events[-1]["event"] == "end" and events[-1]["status"] == "stopped"


# -- a notebook ----------------------------------------------------------------------------------------


NOTEBOOK_CELLS = [
    "import time\nimport workbench\nremote = workbench.attach({out!r})\nprint(remote)",
    "panel = remote.panel()\npanel",
    "status = remote.pause(wait=True, timeout=60)\nassert str(status) == 'paused', status\n"
    "step = remote.snapshot().step\ntime.sleep(1.0)\nassert remote.snapshot().step == step\nprint('paused at', step)",
    "panel.close()\nremote.close()",
]


@pytest.mark.timeout(600)
def test_a_notebook_attaches_to_a_headless_run_and_pauses_it(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")

    out = tmp_path / "out"
    with headless_run(tmp_path) as run:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.format(out=str(out)))
                                             for c in NOTEBOOK_CELLS])
        path = tmp_path / "attach.ipynb"
        nbformat.write(nb, path)
        text = text_of(run_notebook(path, tmp_path / "runs", timeout=300))
        paused_at = int(re.search(r"paused at (\d+)", text).group(1))
        assert "RemoteSession(" in text
        # The kernel has gone; the run is still paused where the notebook paused it.
        status = ctl_status(out, tmp_path)
        assert status["status"] == "paused" and status["step"] == paused_at
        assert workbench("ctl", out, "resume", cwd=tmp_path).returncode == 0
        wait_until(lambda: ctl_status(out, tmp_path)["step"] > paused_at, "the run to resume", every=0.2)
        stop_and_finish(run, out, tmp_path)
    kinds = [e["event"] for e in read_events(out)]
    assert kinds[-1] == "end"


# -- TCP with a token typed on the command line; another user's socket ---------------------------------


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_attach_over_tcp_with_a_token_from_the_command_line(tmp_path):
    out = tmp_path / "out"
    code = tmp_path / "attach-exit-code"
    name = f"wb-tcp-{tmp_path.name}"[:40]
    with headless_run(tmp_path, "--control-port", "0") as run:
        info = read_control(out)
        target, token = info["tcp"], info["token"]
        assert "socket" not in info and token
        # No token, or a wrong one: refused with one line and exit 2; nothing reaches the run.
        for extra in ((), ("--token", "not-the-token")):
            refused = workbench("ctl", target, "pause", *extra, cwd=tmp_path)
            assert refused.returncode == 2 and "token refused" in refused.stderr, refused.stderr
            denied = workbench("attach", target, *extra, cwd=tmp_path)
            assert denied.returncode == 2 and "token refused" in denied.stderr, denied.stderr
        assert ctl_status(out, tmp_path)["status"] == "running"
        assert ctl_status(target, tmp_path, "--token", token)["status"] == "running"

        exe = Path(sys.executable).with_name("workbench")
        command = f"cd {tmp_path} && OMP_NUM_THREADS=1 {exe} attach {target} --token {token}; echo $? > {code}"
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "110", "-y", "32", command], check=True)
        try:
            def shows(text: str) -> bool:
                assert not code.exists(), _capture(name)
                return text in _capture(name)

            wait_until(lambda: shows("RUNNING") and re.search(r"step \d+/100000", _capture(name)),
                       "the dashboard attached over TCP", 120, 0.3)
            # A key pressed while a loaded machine is still drawing the first screen can be
            # lost: pressed again until the run says it is paused (never twice once it is).
            paused = lambda: ctl_status(target, tmp_path, "--token", token)["status"] == "paused"  # noqa: E731
            for _ in range(3):
                _keys(name, "space")
                if poll_until(paused, 30):
                    break
            wait_until(lambda: shows("PAUSED"), "the PAUSED badge", 120, 0.3)
            assert paused()
            _keys(name, "space")
            wait_until(lambda: shows("RUNNING"), "the RUNNING badge again", 120, 0.3)
            _keys(name, "q")
            wait_until(lambda: shows("Detach"), "the quit dialog", 60, 0.3)
            _keys(name, "Enter")
            wait_until(code.exists, "the attached dashboard to exit", 60)
            assert code.read_text().strip() == "0"
        finally:
            subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        stop_and_finish(run, out, tmp_path, "--token", token)


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="chowning a folder to another user needs root")
def test_a_socket_folder_or_socket_of_another_user_is_refused(tmp_path):
    nobody = 65534
    # The run: its runtime folder belongs to another user, so it serves nothing there (and trains).
    xdg = tmp_path / "xdg"
    (xdg / "workbench").mkdir(parents=True, mode=0o700)
    os.chown(xdg / "workbench", nobody, nobody)
    (tmp_path / "run.toml").write_text(CTL_CONFIG.replace("max_steps = 100000", "max_steps = 30"))
    done = subprocess.run([sys.executable, "-m", "workbench", "run", "run.toml", "--headless"], cwd=tmp_path,
                          env={**subprocess_env(), "XDG_RUNTIME_DIR": str(xdg)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "control endpoint not started" in done.stderr and "not a folder owned by this user" in done.stderr
    assert not list((xdg / "workbench").iterdir())

    # The client: a control.json naming a socket that another user owns is not connected to.
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    with headless_run(run_dir) as run:
        out = run_dir / "out"
        socket_file = Path(read_control(out)["socket"])
        os.chown(socket_file, nobody, nobody)
        refused = workbench("ctl", out, "pause", cwd=run_dir)
        assert refused.returncode == 2 and "owned by" in refused.stderr, refused.stderr
        os.chown(socket_file, os.getuid(), os.getgid())
        assert ctl_status(out, run_dir)["status"] == "running"  # the refused pause never reached the run
        stop_and_finish(run, out, run_dir)


# -- two ranks steered by workbench ctl -------------------------------------------------------------


# Imported by every Python process of the launch (PYTHONPATH): each rank records its step ends
# and learning rate, so the test can see that a ctl command took effect at the same step on both.
_RANK_RECORDER = r'''
import json, os, time
if os.environ.get("WB_TEST_RANK_LOG"):
    import workbench.config.build as build
    from workbench import TrainerCallback

    _build = build.build_trainer

    def build_trainer(run):
        trainer = _build(run)
        path = os.path.join(os.environ["WB_TEST_RANK_LOG"], f"rank{trainer.accelerator.process_index}.jsonl")
        log = open(path, "a", buffering=1)

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                lr = trainer.optimizer.param_groups[0]["lr"]
                log.write(json.dumps([state.global_step, time.monotonic(), lr]) + "\n")

        trainer.add_callback(Record())
        return trainer

    build.build_trainer = build_trainer
'''


def _rank_log(folder: Path, rank: int) -> list[tuple[int, float, float]]:
    path = folder / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.endswith("]")]


@pytest.mark.timeout(600)
def test_ctl_steers_two_ranks_at_the_same_step(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_RANK_RECORDER)
    logs = tmp_path / "ranks"
    logs.mkdir()
    (tmp_path / "run.toml").write_text(CTL_CONFIG)
    out = tmp_path / "out"
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "WB_TEST_RANK_LOG": str(logs)}
    run = Spawned([sys.executable, "-m", "workbench", "run", "run.toml", "--headless", "--num-processes", "2"],
                  cwd=tmp_path, env=env, logs=tmp_path / "logs")
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() or run.poll() is not None, "control.json", 240)
        assert run.poll() is None, run.communicate()
        wait_until(lambda: ctl_status(out, tmp_path)["step"] >= 20, "twenty steps", every=0.2)
        paused = workbench("ctl", out, "pause", "--wait", cwd=tmp_path)
        assert paused.returncode == 0 and "paused" in paused.stdout, paused.stderr
        step = ctl_status(out, tmp_path)["step"]
        # Both ranks stop at the paused step and stay there.
        wait_until(lambda: all(_rank_log(logs, r) and _rank_log(logs, r)[-1][0] == step for r in (0, 1)),
                   f"both ranks at step {step}", 60)
        time.sleep(1.0)
        assert [_rank_log(logs, r)[-1][0] for r in (0, 1)] == [step, step], "a rank moved while paused"

        edited = workbench("ctl", out, "set", "learning_rate=0.05", "--reason", "two-rank check", cwd=tmp_path)
        assert edited.returncode == 0, edited.stderr
        saved = workbench("ctl", out, "save", "--json", cwd=tmp_path)
        assert saved.returncode == 0, saved.stderr
        checkpoint = Path(json.loads(saved.stdout)["checkpoint"])
        assert checkpoint.name == f"checkpoint-{step}"
        assert CheckpointStore(out).verify(checkpoint) == (True, None)
        assert (checkpoint / "rng_state_1.pth").is_file()  # rank 1 took part in the save
        assert workbench("ctl", out, "resume", cwd=tmp_path).returncode == 0
        wait_until(lambda: ctl_status(out, tmp_path)["step"] > step + 10, "ten steps after resuming", every=0.2)
        stop_and_finish(run, out, tmp_path)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    zero, one = _rank_log(logs, 0), _rank_log(logs, 1)
    for ranks_log in (zero, one):
        # The pause: the one long gap between step ends is before step+1 on each rank.
        gaps = [(b[1] - a[1], b[0]) for a, b in zip(ranks_log, ranks_log[1:])]
        assert max(gaps)[1] == step + 1 and max(gaps)[0] > 1.0
    lr0 = {s: lr for s, _, lr in zero}
    lr1 = {s: lr for s, _, lr in one}
    assert lr0 == lr1, "the ranks' learning rates differ at some step"
    assert lr0[step] < 0.011 and lr0[step + 1] > 0.04  # the edit took effect from the pause on, on both
    assert max(lr0) == max(lr1)  # both stopped at the same step
    final = CheckpointStore(out).list()[-1]
    assert final.step == max(lr0) and (Path(final.path) / "rng_state_1.pth").is_file()
    state = json.loads((Path(final.path) / "workbench_state.json").read_text())  # live edits live here
    edits = state["live_edits"]
    assert [(e["step"], e["learning_rate"], e["reason"]) for e in edits] == [(step, 0.05, "two-rank check")]


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_a_dashboard_run_branched_by_ctl_follows_the_branch_and_quits_from_it(tmp_path):
    """``workbench run`` with its dashboard, then ``workbench ctl OUT checkpoints branch``: the
    dashboard follows the branch (it now trains in the process), q then Enter stops and
    saves the branch, and the CLI's last line names the branch's folder."""
    out, branch_dir = tmp_path / "out", tmp_path / "low-lr"
    (tmp_path / "run.toml").write_text(CTL_CONFIG)
    code = tmp_path / "exit-code"
    name = f"wb-branch-{tmp_path.name}"[:40]
    exe = Path(sys.executable).with_name("workbench")
    # The pane stays after the exit (the app draws on the terminal, so its last lines are read there).
    command = f"cd {tmp_path} && OMP_NUM_THREADS=1 {exe} run run.toml; echo $? > {code}; sleep 120"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "110", "-y", "32", command], check=True)
    try:
        def shows(text: str) -> bool:
            assert not code.exists(), _capture(name)
            return text in _capture(name)

        wait_until(lambda: shows("RUNNING") and (out / CONTROL_FILE).exists(), "the dashboard", 120, 0.3)
        wait_until(lambda: ctl_status(out, tmp_path)["step"] >= 10, "ten steps", every=0.2)
        saved = workbench("ctl", out, "save", "--json", cwd=tmp_path)
        checkpoint = Path(json.loads(saved.stdout)["checkpoint"]).name
        branched = workbench("ctl", out, "checkpoints", "branch", checkpoint, "low-lr", "learning_rate=1e-3",
                             cwd=tmp_path)
        assert branched.returncode == 0, branched.stderr
        wait_until(lambda: (branch_dir / CONTROL_FILE).exists() and ctl_status(branch_dir, tmp_path)["step"] > 0,
                   "the branch to train", every=0.2)
        # The dashboard steers the branch once it follows it: space pauses the branch (its
        # note may have scrolled out of the small events pane, behind the branch's own
        # events). A space pressed before it followed only says the old run has ended.

        def space_pauses_the_branch() -> bool:
            if ctl_status(branch_dir, tmp_path)["status"] not in ("pausing", "paused"):
                _keys(name, "space")
            return poll_until(lambda: ctl_status(branch_dir, tmp_path)["status"] == "paused", 3.0, every=0.2)

        wait_until(space_pauses_the_branch, "space in the dashboard to pause the branch", 90, 0)
        wait_until(lambda: shows("PAUSED"), "the PAUSED badge", 60, 0.3)
        _keys(name, "q")
        wait_until(lambda: shows("Stop and save"), "the quit dialog", 60, 0.3)
        _keys(name, "Enter")
        wait_until(code.exists, "workbench run to exit", 120)
        stderr = _capture(name).replace("\n", "")  # lines the terminal wrapped, joined
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    assert code.read_text().strip() == "0", stderr
    assert f"checkpoint saved in {branch_dir}" in stderr, stderr
    assert "until it ends" not in stderr  # the dashboard had followed the branch to its end
    end = read_events(branch_dir)[-1]
    assert (end["event"], end["saved"]) == ("end", True)
    assert any(branch_dir.glob("checkpoint-*"))


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_watch_in_a_real_terminal_shows_a_run_with_a_thousand_long_edits(tmp_path, sessions):
    """The history that once put every snapshot over the line limit (watch crashed, and exited 0)."""
    out = tmp_path / "run"
    session = running(out, sessions)
    session.pause(wait=True, timeout=60)
    for i in range(1000):
        session.set(lr_scale=1.0, reason=f"{i}: " + "the eval loss has not improved for three evaluations " * 9)
    session.save()
    session.resume()
    code, name = tmp_path / "watch-exit-code", f"wb-watch-{tmp_path.name}"[:40]
    exe = Path(sys.executable).with_name("workbench")
    command = f"cd {tmp_path} && OMP_NUM_THREADS=1 {exe} watch {out}; echo $? > {code}"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "110", "-y", "32", command], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout

    try:
        wait_until(lambda: "RUNNING" in screen() or code.exists(), "the watched run on the screen", 120)
        assert not code.exists(), screen()
        time.sleep(2.0)  # several polls of the 1,000-edit snapshot
        assert "RUNNING" in screen() and not code.exists(), screen()

        def footer() -> list[list[str]]:  # the key bar, polled: a capture can land between two frames
            return [line.split() for line in screen().splitlines() if re.search(r"(^|\s)quit(\s|$)", line)]
        keys = wait_until(footer, "the key bar at the bottom", 30, 0.3)[-1]
        assert not {"pause", "save", "eval", "edit", "inspect"} & set(keys), keys  # read-only
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)  # read-only: q leaves, no dialog
        wait_until(code.exists, "watch to exit", 60)
        assert code.read_text().strip() == "0", screen()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    assert session.status == Status.RUNNING
