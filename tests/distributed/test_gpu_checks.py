"""benchmarks/gpu_checks.py, the script a lent GPU machine runs, kept working on the CPU.

No GPU runs these tests: the script's ``--device cpu`` mode runs every check that applies on
the CPU (the guard's device path forced, the CPU proxy of the sync counter, gloo ranks), so
the script cannot rot between GPU sessions. The runner's own behaviour (time limits, a
missing GPU, bad options) is checked with quick runs.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from support import REPO

SCRIPT = REPO / "benchmarks" / "gpu_checks.py"


def run_script(*options: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *options], capture_output=True, text=True, timeout=timeout)


def lines_by_check(stdout: str) -> dict[str, str]:
    """{check: status} from the report's one line per check."""
    out = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("PASS", "FAIL", "SKIP"):
            out[words[1]] = words[0]
    return out


def test_a_check_over_its_time_limit_is_killed_and_fails():
    start = time.monotonic()
    result = run_script("--device", "cpu", "--only", "env", "--check-timeout", "0.3")
    assert result.returncode == 1
    assert lines_by_check(result.stdout) == {"env": "FAIL"}
    assert "timed out after 0.3 s" in result.stdout
    assert time.monotonic() - start < 60  # it did not wait for the check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_cuda_mode_fails_env_and_skips_the_rest():
    result = run_script("--device", "cuda", "--only", "env,guard,ranks")
    assert result.returncode == 1, result.stdout + result.stderr
    assert lines_by_check(result.stdout) == {"env": "FAIL", "guard": "SKIP", "ranks": "SKIP"}
    assert "torch.cuda.is_available() is False" in result.stdout
    assert "no usable CUDA device (see env)" in result.stdout


def test_unknown_check_names_are_one_line_errors():
    result = run_script("--only", "env,nope")
    assert result.returncode == 2
    assert "--only: unknown check(s) nope; choose from env, precision" in result.stderr
