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


def _wait_screen(name: str, status: Path, condition, what: str, timeout: float) -> str:
    """The tmux pane's text once ``condition`` holds; fails naming ``what``, with the screen,
    after ``timeout`` or when the program has ended (its exit code written to ``status``)."""
    deadline = time.monotonic() + timeout
    while True:
        screen = _capture(name)
        if condition(screen):
            return screen
        if time.monotonic() > deadline or status.exists():
            raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen}")
        time.sleep(0.3)


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
            return _wait_screen(name, status, condition, what, timeout)

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


STEER_SCRIPT = '''
import sys, time
from workbench import Session, Trainer, TrainerCallback, TrainingArguments
from workbench.autopilot import Action, Autopilot, Limits
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier
from workbench.widgets.tui import run_dashboard


class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.02)


class HalveOnce:
    """Proposes halving the learning rate once, past step 20."""
    name = "halve-once"

    def __init__(self):
        self.asked = False

    def observe(self, seen):
        if self.asked or seen.step < 20:
            return None
        self.asked = True
        return Action({"lr_scale": 0.5}, "scripted: halve the rate once")


train, evals = load_builtin_data("random-classification", n_train=4096, n_eval=64, in_features=8, num_classes=3)
args = TrainingArguments(sys.argv[1], max_steps=20000, per_device_train_batch_size=16, learning_rate=0.01,
                         logging_steps=5, eval_strategy="steps", eval_steps=50, save_strategy="no",
                         report_to="none", disable_tqdm=True)
session = Session(Trainer(model=MLPClassifier(in_features=8, hidden=16, num_classes=3), args=args,
                          train_dataset=train, eval_dataset=evals, callbacks=[Slow()]))
pilot = Autopilot(session, HalveOnce(), Limits({"lr_scale": (0.25, 1.0)}), dry_run=True, interval=0.2)
session.start()
pilot.start()
outcome = run_dashboard(session, autopilot=pilot)
pilot.stop()
print(outcome)
'''

BRAILLE = set(chr(c) for c in range(0x2801, 0x2900))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_the_autopilots_proposal_the_schedule_preview_and_a_fork_in_a_real_terminal(tmp_path):
    """In tmux: the autopilot's dry-run proposal is shown and accepted with o / y, the edit form
    previews a typed schedule change (more dashes drawn, nothing applied), and the fork screen
    forks two variants from the pause, shows their table and keeps one."""
    import re

    script, status = tmp_path / "steer.py", tmp_path / "exit-code"
    script.write_text(STEER_SCRIPT)
    name = f"wb-steer-{tmp_path.name}"[:40]
    command = f"cd {tmp_path} && PYTHONPATH={REPO} {sys.executable} {script} {tmp_path / 'out'}; echo $? > {status}"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "60", command], check=True)

    def keys(*sent: str) -> None:
        for key in sent:
            subprocess.run(["tmux", "send-keys", "-t", name, key], check=True)
            time.sleep(0.15)

    def wait_screen(condition, what: str, timeout: float = 180.0) -> str:
        return _wait_screen(name, status, condition, what, timeout)

    try:
        wait_screen(lambda s: "autopilot proposes lr_scale=0.5" in s or "proposed" in s, "the autopilot's proposal")
        keys("o")
        wait_screen(lambda s: "dry run: proposals wait for you" in s and "proposed" in s, "the autopilot screen")
        keys("y")
        wait_screen(lambda s: "applied" in s, "the proposal applied")
        keys("Escape", "space")
        wait_screen(lambda s: "PAUSED" in s, "the pause")

        keys("l")
        before = wait_screen(lambda s: "planned learning rate" in s and sum(c in BRAILLE for c in s) >= 8,
                             "the edit form with the current plan")
        keys(*["Tab"] * 6)
        keys("decay_now steps=30")
        wait_screen(lambda s: re.search(r"or the schedule\s+decay_now steps=30", s), "the change typed in its field")
        wait_screen(lambda s: sum(c in BRAILLE for c in s) > sum(c in BRAILLE for c in before),
                    "the change's preview drawn beside the plan")
        keys("Escape")  # nothing applied
        wait_screen(lambda s: "PAUSED" in s and "planned learning rate" not in s, "the form closed")

        keys("f")
        wait_screen(lambda s: "variants" in s and "Fork (ctrl+f)" in s, "the fork screen")
        keys("1e-2", "Tab", "BSpace", "BSpace", "4", "C-f")
        screen = wait_screen(lambda s: "keep one or discard" in s, "the fork's report", timeout=120)
        assert re.search(r"fork 1: 4 steps from step \d+", screen) and "same batches" in screen
        assert "learning_rate=0.01" in screen and "(unchanged)" in screen
        keys("Down", "k")
        wait_screen(lambda s: "kept b" in s, "variant b kept")
        keys("Escape", "q")
        wait_screen(lambda s: "Stop and save" in s, "the quit dialog")
        keys("Enter")
        poll_until(status.exists, 120, every=0.5)
        assert status.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
