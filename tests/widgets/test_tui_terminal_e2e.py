"""The dashboard in a real terminal (tmux), end to end: ``workbench run`` as a user starts it,
read from the screen and steered with real keys.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.checkpoint.store import CheckpointStore

from support import REPO, poll_until

# ----------------------------------------------------------------------------- a real terminal


def _capture(session_name: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session_name], capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_workbench_run_in_a_real_terminal(tmp_path):
    out = tmp_path / "out"
    status = tmp_path / "exit-code"
    name = f"wb-{tmp_path.name}"[:40]
    workbench = Path(sys.executable).with_name("workbench")
    command = (f"cd {REPO} && {workbench} run examples/tiny-gpt.toml --set training.output_dir={out} "
               f"--set training.max_steps=5000 --set training.save_strategy=no; echo $? > {status}")
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "100", "-y", "30", command], check=True)
    try:
        def wait_screen(condition, what: str, timeout: float = 240.0) -> str:
            deadline = time.monotonic() + timeout
            while True:
                screen = _capture(name)
                if condition(screen):
                    return screen
                if time.monotonic() > deadline or status.exists():
                    raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen}")
                time.sleep(0.5)

        import re

        def trained(screen: str) -> bool:
            match = re.search(r"step (\d+)/5000", screen)
            return "RUNNING" in screen and match is not None and int(match.group(1)) >= 55

        # Two log points (logging_steps 25): a line needs two; one point draws nothing.
        wait_screen(trained, "the dashboard training past step 55 (two log points)")
        subprocess.run(["tmux", "send-keys", "-t", name, "space"], check=True)
        screen = wait_screen(lambda s: "PAUSED" in s, "the PAUSED badge")
        assert "loss" in screen and "eval" in screen
        assert any(ch in screen for ch in "⠁⠂⠄⡀⢀⠠⠐⠈⣀⠤⠒⠉"), f"no chart line drawn:\n{screen}"  # braille dots
        step = int(re.search(r"step (\d+)/5000", screen).group(1))
        time.sleep(1.0)
        assert f"step {step}/5000" in _capture(name), "the step moved while paused"

        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        wait_screen(lambda s: "Stop and save" in s, "the quit dialog")
        subprocess.run(["tmux", "send-keys", "-t", name, "Enter"], check=True)
        poll_until(status.exists, 120, every=0.5)
        assert status.read_text().strip() == "0"
        checkpoints = CheckpointStore(out).list()
        # Stopped while paused: saved at the paused step, no further step trained.
        assert [c.step for c in checkpoints] == [step]
        assert CheckpointStore(out).verify(checkpoints[0].path) == (True, None)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
