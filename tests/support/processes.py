"""workbench in a subprocess, as a user types it, and processes whose output goes to files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Variables a parent launcher may have set that would make a child think it is one rank of a job.
_LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child run: this checkout importable, one intra-op thread (the
    machine's cores are shared), no launcher variables inherited, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def workbench(*args: object, cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    """``workbench ARGS`` run to its end in ``cwd``; ``env`` adds variables."""
    return subprocess.run([sys.executable, "-m", "workbench", *map(str, args)], cwd=cwd,
                          env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


def start_workbench(*args: object, cwd: Path, env: dict[str, str] | None = None) -> Spawned:
    """``workbench ARGS`` started in ``cwd`` (its output in ``cwd/logs``); the caller waits or kills."""
    return Spawned([sys.executable, "-m", "workbench", *map(str, args)], cwd=cwd,
                   env=subprocess_env(**(env or {})), logs=cwd / "logs")


def listening_socket() -> socket.socket:
    """A socket listening on a free loopback port: the port is taken while it is open."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def free_port() -> int:
    """A loopback port nobody listens on right now (it may be taken again before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned(subprocess.Popen):
    """A process whose stdout and stderr go to files in ``logs``, read back by ``communicate``.

    A long run's progress lines fill an unread pipe (64 KiB) within a minute or so, and the
    run then blocks on its next print: a test that steers a live run must never hand it one.
    """

    def __init__(self, args: list[str], *, logs: Path, **kwargs: Any) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        stem = f"spawned-{time.monotonic_ns()}"
        self.paths = (logs / f"{stem}.stdout", logs / f"{stem}.stderr")
        self._files = [open(path, "w", encoding="utf-8") for path in self.paths]  # noqa: SIM115 - closed by communicate
        super().__init__(args, stdout=self._files[0], stderr=self._files[1], text=True, **kwargs)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[str, str]:  # noqa: A002
        """Wait for the process (raising TimeoutExpired like Popen) and return (stdout, stderr)."""
        self.wait(timeout)
        for f in self._files:
            f.close()
        return tuple(path.read_text(encoding="utf-8", errors="replace") for path in self.paths)  # type: ignore[return-value]


def outcome(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    """Wait for ``proc`` (a deadline, not a pace) and return (exit code, stdout, stderr)."""
    stdout, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stdout, stderr
