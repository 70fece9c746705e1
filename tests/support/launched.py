"""``workbench run`` as a real subprocess, signalled from outside the way a scheduler or a
user would, and its events followed as they are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from workbench.core.event_file import read_events

from support.processes import REPO


@dataclass
class Run:
    """One ``workbench run`` subprocess; stdout and stderr go to files (pipes could fill up)."""

    proc: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"workbench run did not finish within {timeout} s:\n{self.stderr}") from None

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(encoding="utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")


def launch(config: Path, *extra: str, logs: Path, tag: str, env: dict[str, str] | None = None,
           pythonpath: tuple[Path, ...] = ()) -> Run:
    """Start ``workbench run CONFIG --headless *extra``; ``env`` adds variables and
    ``pythonpath`` folders in front of the repository on PYTHONPATH (a user's modules)."""
    # One intra-op thread: on a small shared machine two threads per process oversubscribe
    # the cores (a step can take 100x longer under load). Every run here, the uninterrupted
    # reference included, uses the same setting, so the bitwise comparisons are like for like.
    path = os.pathsep.join(str(p) for p in (*pythonpath, REPO))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    logs.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = logs / f"{tag}.out", logs / f"{tag}.err"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(config), "--headless", *extra],
                                cwd=config.parent, env=env, stdout=out, stderr=err)
    return Run(proc, stdout_path, stderr_path)


class EventTail:
    """Follows ``events.jsonl`` from its current end: only lines written after creation.

    Starting at the current size also sidesteps a torn last line left by a killed process:
    the fragment lies before the offset, so the next process's first line parses.
    """

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / "events.jsonl"
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.pending = b""
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        data = self.pending + chunk
        *lines, self.pending = data.split(b"\n")
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.events.extend(new)
        return new

    def wait_for(self, run: Run, predicate, timeout: float = 120.0) -> dict | None:
        """The first new event matching ``predicate``; None when the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = run.proc.poll() is not None
            for event in self.poll():
                if predicate(event):
                    return event
            if exited:
                return None
            time.sleep(0.003)
        run.proc.kill()
        run.proc.wait()
        raise AssertionError(f"no matching event within {timeout} s; stderr:\n{run.stderr}")


def final_weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = output_dir / f"checkpoint-{step}" / "model.safetensors"
    assert path.is_file(), f"no final checkpoint {path.parent.name} in {sorted(p.name for p in output_dir.iterdir())}"
    return load_file(str(path))


def run_to_completion(config: Path, output_dir: Path, logs: Path, tag: str, *extra: str, **launch_options) -> Run:
    run = launch(config, *extra, logs=logs, tag=tag, **launch_options)
    code = run.wait()
    assert code == 0, f"{tag}: exit {code}\n{run.stderr}"
    events = read_events(output_dir)
    assert events[-1]["event"] == "end" and events[-1]["status"] == "finished", events[-1]
    return run
