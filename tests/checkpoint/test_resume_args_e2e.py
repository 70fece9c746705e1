"""Resuming with changed arguments, end to end: the CLI resumes a run with --set overrides, warns
about each one that differs from the checkpoint's and applies the live-editable ones.
"""

from __future__ import annotations

import os
import subprocess
import sys

import tomli_w

from support import REPO, checkpoint_steps
from test_resume_args import STOP, WARNING_PREFIX, saved_state


def test_cli_resume_with_set_applies_and_warns(tmp_path):
    out = tmp_path / "runs"
    config = tmp_path / "cfg.toml"
    config.write_text(tomli_w.dumps({
        "model": {"builtin": "tiny-gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}},
        "data": {"builtin": "python-source", "options": {"block_size": 16, "max_chars": 5000}},
        "training": {"output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 2,
                     "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-3, "seed": 3},
    }))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "workbench.cli", "run", str(config), "--headless", *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    first = cli()
    assert first.returncode == 0, first.stderr
    assert checkpoint_steps(out) == [2, 4]
    resumed = cli("--resume", "--set", "training.save_steps=3", "--set", "training.max_steps=9")
    assert resumed.returncode == 0, resumed.stderr
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("resuming from")]
    assert len(lines) == 2, resumed.stderr
    assert lines[0].startswith(f"{WARNING_PREFIX} max_steps is 9 in this launch but 4")
    assert lines[1].startswith(f"{WARNING_PREFIX} save_steps is 3 in this launch but 2")
    assert checkpoint_steps(out) == [2, 4, 6, 9]
    [record] = saved_state(out / "checkpoint-9")["live_edits"]
    assert record["step"] == STOP and record["save_steps"] == 3 and record["max_steps"] == 9
