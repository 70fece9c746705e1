"""The autopilot's examples end to end, in processes of their own (issue 28):
examples/agent_llm_policy.py runs offline as shipped (a local run, the stand-in model), and
examples/agent_lr_policy.py steers a headless ``workbench run`` in another process through
``workbench.attach``: every change it makes is in the run's events.jsonl with its reason."""

from __future__ import annotations

import subprocess
import sys

from workbench.core.event_file import read_events

from support import REPO, subprocess_env
from support.headless import CTL_CONFIG, headless_run

# The ctl run, evaluated every 10 steps with a learning rate of 0: its eval loss never improves.
PLATEAU_CONFIG = (CTL_CONFIG.replace("max_steps = 100000", "max_steps = 300")
                  .replace("learning_rate = 1e-2", "learning_rate = 0.0")
                  + 'eval_strategy = "steps"\neval_steps = 10\n')


def example(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


def test_the_llm_example_runs_offline_and_records_its_decisions(tmp_path):
    done = example("agent_llm_policy.py", "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "llm: lr_scale=0.5 [applied]" in done.stdout
    edits = [e for e in read_events(tmp_path / "run") if e["event"] == "edit"]
    assert edits and all(e["reason"].startswith("autopilot/llm: ") for e in edits)
    assert all(e["lr_scale"] == 0.5 for e in edits)


def test_the_plateau_example_steers_a_headless_run_in_another_process(tmp_path):
    with headless_run(tmp_path, config=PLATEAU_CONFIG) as run:
        done = example("agent_lr_policy.py", str(tmp_path / "out"), "--patience", "2", "--max-cuts", "2",
                       cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        run.communicate(timeout=180)
        assert run.returncode == 0
    assert "2 change(s) applied" in done.stdout
    edits = [e for e in read_events(tmp_path / "out") if e["event"] == "edit"]
    assert [e["lr_scale"] for e in edits] == [0.5, 0.5]
    assert all(e["reason"].startswith("autopilot/plateau: eval_loss ") for e in edits)
    assert "[refused]" not in done.stdout or "at most 2" in done.stdout  # a third cut: over the limit
