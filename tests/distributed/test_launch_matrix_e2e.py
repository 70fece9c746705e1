"""Every way of launching a multi-process run, end to end: ``accelerate launch``, ``torchrun``,
``python -m workbench`` and the CLI's own launcher, each with the same results, and a rank
killed from outside.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.checkpoint.store import CheckpointStore

from support import Spawned, free_port, poll_until, subprocess_env
from test_launch_matrix import history_of, run_launch, workbench_command, write_project


def _losses(checkpoint: Path) -> tuple[list[float], list[float]]:
    history = history_of(checkpoint)
    return [h["loss"] for h in history if "loss" in h], [h["eval_loss"] for h in history if "eval_loss" in h]


def _launch_forms(config: Path) -> dict[str, list[list[str]]]:
    """Each form: the commands to start together (two for the two-"node" launch)."""
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    port = str(free_port())
    nodes = [[*accelerate, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(rank),
              "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--num_processes", "2",
              "--mixed_precision", "no", "--dynamo_backend", "no",
              "-m", "workbench", "run", str(config), "--headless"] for rank in (0, 1)]
    return {
        "workbench --num-processes": [workbench_command("run", str(config), "--headless", "--num-processes", "2")],
        "accelerate launch --multi_gpu": [[*accelerate, "--multi_gpu", "--num_processes", "2",
                                           "--main_process_port", port, "--mixed_precision", "no",
                                           "--dynamo_backend", "no", "-m", "workbench", "run", str(config),
                                           "--headless"]],
        "torchrun": [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                      "--master-port", port, "-m", "workbench", "run", str(config), "--headless"]],
        "two nodes": nodes,
    }


def _start_all(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=cwd)
             for c in commands]
    results = []
    for command, proc in zip(commands, procs):
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return results


def _rank_pid(config: Path, rank: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if str(config).encode() in cmdline and f"\0RANK={rank}\0".encode() in b"\0" + environ \
                    and b"accelerate" not in cmdline:
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} of {config} not found")


def test_every_launch_form_trains_one_run_with_user_data(tmp_path):
    single = run_launch(workbench_command("run", str(write_project(tmp_path, "single", batch=8)), "--headless"), tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    train1, eval1 = _losses(tmp_path / "single" / "checkpoint-10")
    assert len(train1) == 10 and len(eval1) == 2

    for i, (form, commands) in enumerate(_launch_forms(write_project(tmp_path, "two", batch=4)).items()):
        out = tmp_path / "two"
        if out.exists():
            import shutil

            shutil.rmtree(out)
        for attempt in range(2):  # a free port can be taken before the launcher binds it
            if attempt:
                commands = _launch_forms(tmp_path / "two.toml")[form]
            results = _start_all(commands, tmp_path)
            if all(r.returncode == 0 for r in results) or "address already in use" not in \
                    "".join(r.stderr for r in results).lower():
                break
        for r in results:
            assert r.returncode == 0, f"{form}: {r.stderr[-3000:]}"
        # Printed once, by rank 0 only.
        printed = "".join(r.stdout for r in results)
        assert printed.count("workbench: finished") == 1, f"{form}: {printed[-2000:]}"

        final = out / "checkpoint-10"
        assert CheckpointStore(out).verify(final) == (True, None), form
        files = set(json.loads((final / "manifest.json").read_text())["files"])
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= files and "rng_state.pth" not in files, form
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events].count("start") == 1, form
        assert [e["event"] for e in events].count("end") == 1, form
        logged = [e["step"] for e in events if e["event"] == "log" and "loss" in e]
        assert logged == list(range(1, 11)), f"{form}: {logged}"
        assert not (out / ".lock").exists(), form

        train2, eval2 = _losses(final)
        assert train2 == pytest.approx(train1, rel=1e-5, abs=1e-5), form
        assert eval2 == pytest.approx(eval1, rel=1e-5, abs=1e-5), form


def test_a_rank_killed_mid_run_ends_the_launch_and_the_newest_checkpoint_resumes(tmp_path):
    config = write_project(tmp_path, "long", max_steps=100000)
    out = tmp_path / "long"
    launcher = Spawned(workbench_command("run", str(config), "--headless", "--num-processes", "2"), env=subprocess_env(),
                       cwd=tmp_path, logs=tmp_path / "logs")
    try:
        assert poll_until((out / "checkpoint-15").is_dir, 180, every=0.2), "the run did not reach step 15"
        os.kill(_rank_pid(config, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.communicate(timeout=120)
        waited = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode not in (0, None)
    assert waited < 60, f"the launch took {waited:.0f} s to end after a rank died"
    assert not (out / ".lock").exists()  # the parent released it

    newest = CheckpointStore(out).latest_verified()
    assert newest is not None and newest.step >= 15
    target = newest.step + 5
    resumed = run_launch(workbench_command("run", str(config), "--headless", "--num-processes", "2", "--resume",
                              "--set", f"training.max_steps={target}"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = out / f"checkpoint-{target}"
    assert CheckpointStore(out).verify(final) == (True, None)
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(final))
    steps = [h["step"] for h in history_of(final) if "loss" in h]
    assert steps[-5:] == list(range(newest.step + 1, target + 1))
