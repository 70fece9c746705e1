"""A headless ``workbench run`` to steer from outside: the run config, the process until it
serves its endpoint, and ``workbench ctl`` against it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workbench.control.discovery import CONTROL_FILE

from support.processes import start_workbench, workbench
from support.waiting import wait_until

# A small MLP run that goes on until stopped, logging every 10 steps and saving nothing.
CTL_CONFIG = """\
run_name = "ctl"
[model]
builtin = "mlp"
[model.options]
in_features = 8
num_classes = 3
[data]
builtin = "random-classification"
[data.options]
n_train = 64
n_eval = 16
in_features = 8
num_classes = 3
[training]
output_dir = "out"
max_steps = 100000
per_device_train_batch_size = 4
learning_rate = 1e-2
logging_steps = 10
save_strategy = "no"
report_to = "none"
"""


def ctl_status(out: Path, cwd: Path, *extra: str) -> dict:
    """``workbench ctl OUT status --json EXTRA``, parsed."""
    result = workbench("ctl", out, "status", "--json", *extra, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@contextmanager
def headless_run(tmp_path: Path, *extra: str, config: str = CTL_CONFIG) -> Iterator[subprocess.Popen]:
    """``workbench run run.toml --headless EXTRA`` until its control.json is written; killed on the way out."""
    (tmp_path / "run.toml").write_text(config)
    out = tmp_path / "out"
    run = start_workbench("run", "run.toml", "--headless", *extra, cwd=tmp_path)
    try:
        wait_until(lambda: (out / CONTROL_FILE).exists() or run.poll() is not None, "control.json", 180, every=0.2)
        assert run.poll() is None, run.communicate()
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def stop_and_finish(run: subprocess.Popen, out: Path, cwd: Path, *extra: str) -> str:
    """``workbench ctl OUT stop``, then the run's exit: 0 (stopped and saved, as documented)."""
    stopped = workbench("ctl", out, "stop", *extra, cwd=cwd)
    assert stopped.returncode == 0, stopped.stderr
    _, stderr = run.communicate(timeout=180)
    assert run.returncode == 0, stderr
    assert "checkpoint saved" in stderr
    return stderr
