"""``workbench run --num-processes N``: start the ranks through Accelerate's launcher.

This process stays as a thin parent: it picks a free rendezvous port, runs
``accelerate launch ... -m workbench run CONFIG`` and waits. Signals it receives go to the
ranks themselves (not to the launcher, whose own handler would give them only 30 seconds
before killing them), so a SIGTERM becomes one coordinated checkpoint however long the
save takes. Rank 0 reports the run's exit code through a file, because the launcher turns
any non-zero worker exit (143 after a preemption save) into its own generic failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workbench.core.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED

__all__ = ["launch_ranks", "EXIT_FILE_ENV", "report_exit_code", "launched_by_workbench"]

EXIT_FILE_ENV = "WORKBENCH_EXIT_FILE"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerate_config_in_effect(config_file: str | None) -> str | None:
    """The accelerate config file the launcher will read (explicit, else the default one)."""
    if config_file:
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"--accelerate-config: {config_file} does not exist; "
                                    "write one with 'accelerate config --config_file PATH'")
        return config_file
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) else None


def launcher_command(num_processes: int, program: list[str], config_file: str | None = None,
                     port: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The ``accelerate launch`` command line and environment that runs ``program`` (a script
    and its arguments, or ``["-m", module, ...]``) on ``num_processes`` ranks.

    Without an accelerate config file this machine's devices decide: one rank per GPU
    when CUDA is there, else CPU ranks in a gloo group (Accelerate needs ``--multi_gpu``
    to start several processes and ``ACCELERATE_USE_CPU`` to put them on the CPU).
    """
    import torch

    env = dict(os.environ)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
               "--main_process_port", str(port or _free_port())]
    config = _accelerate_config_in_effect(config_file)
    if config is not None:
        command += ["--config_file", config]
    else:
        command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if num_processes > 1:
            command.append("--multi_gpu")
        if not torch.cuda.is_available():
            env["ACCELERATE_USE_CPU"] = "1"
            # Two ranks on a few cores: one thread each, or they fight over the cores.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_processes)))
    return command + list(program), env


def _worker_pids(launcher_pid: int) -> list[int]:
    """The launcher's child processes (the ranks), from /proc; empty where that is unavailable."""
    pids: list[int] = []
    try:
        for task in Path(f"/proc/{launcher_pid}/task").iterdir():
            children = (task / "children").read_text().split()
            pids.extend(int(p) for p in children)
    except OSError:
        return []
    return pids


def launch_ranks(num_processes: int, worker_args: list[str], config_file: str | None = None,
                 extra_env: dict[str, str] | None = None) -> int:
    """Run the ranks and return the run's exit code (rank 0's, as core/exit_codes.py defines them)."""
    command, env = launcher_command(num_processes, ["-m", "workbench", *worker_args], config_file)
    with tempfile.TemporaryDirectory(prefix="workbench-launch-") as tmp:
        exit_file = Path(tmp) / "exit-code"
        env[EXIT_FILE_ENV] = str(exit_file)
        env.update(extra_env or {})
        proc = subprocess.Popen(command, env=env, start_new_session=True)
        received: list[int] = []

        def forward(signum, frame):  # noqa: ARG001 - signal handler signature
            received.append(signum)
            if len(received) > 1 and signum == signal.SIGINT:
                # A second Ctrl-C: do not wait for the save.
                os.killpg(proc.pid, signal.SIGKILL)
                return
            targets = _worker_pids(proc.pid) or [proc.pid]
            for pid in targets:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                try:
                    code = proc.wait()
                    break
                except KeyboardInterrupt:  # pragma: no cover - the handler above replaces it
                    continue
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
        if exit_file.is_file():
            try:
                return int(exit_file.read_text().strip())
            except ValueError:
                pass
        if received and received[-1] == signal.SIGINT:
            return EXIT_INTERRUPTED
        return code if code != 0 else EXIT_FAILED  # rank 0 never reported: it did not finish


def launched_by_workbench() -> bool:
    """Whether this rank was started by ``workbench run --num-processes`` (the parent reads the code)."""
    return bool(os.environ.get(EXIT_FILE_ENV))


def report_exit_code(code: int, is_main: bool) -> int:
    """Record rank 0's exit code for the parent; returns the code this process should exit with.

    Under the workbench parent a rank that stopped as asked (saved, 130/143) exits 0, so the
    launcher does not report it as a crashed worker; failures keep their code so the launcher
    tears the other ranks down.
    """
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return code
    if is_main:
        tmp = Path(f"{path}.{os.getpid()}.{time.time_ns()}")
        tmp.write_text(f"{code}\n")
        os.replace(tmp, path)
    return EXIT_OK if code in (EXIT_OK, EXIT_INTERRUPTED, EXIT_TERMINATED) else code
