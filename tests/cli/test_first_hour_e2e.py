"""The first hour of a new user, end to end (issue 29): the README's notebook install line
runs a sample notebook from the command line; the demo says it trains within its first
step; a second run into a live run's folder is told the folder is in use before anything
about its checkpoints; ``--overwrite`` says what it deleted; a stop from an attached
client is told in the run's own output and in its end, in the same words."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from workbench.control.client import attach
from workbench.core.event_file import read_events

from support import REPO, workbench
from support.headless import headless_run
from support.notebooks import kernel_env
from support.processes import start_workbench


def _readme_notebook_line() -> str:
    """The README's command that installs the notebook extra and executes a notebook."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines()
             if "pip install" in line and "[notebook]" in line and "sample_notebooks/" in line]
    assert len(lines) == 1, lines
    return lines[0]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


@pytest.mark.timeout(900)
def test_the_readme_notebook_install_line_executes_a_sample_notebook(tmp_path):
    line = _readme_notebook_line()
    install, _, command = line.partition(" && ")
    extras = re.search(r"\.\[([\w,]+)\]", install).group(1).split(",")
    assert extras == ["notebook"]
    # The command it names comes with that extra: `jupyter execute` is nbclient's (and jupyter_core's).
    words = shlex.split(command)
    assert words[:2] == ["jupyter", "execute"] and words[2].startswith("sample_notebooks/")
    wanted = _requirement_names(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                                ["optional-dependencies"]["notebook"])
    script = next(iter(metadata.entry_points(group="console_scripts", name="jupyter-execute")))
    assert script.dist.name.lower() in wanted, (script.dist.name, wanted)
    assert "jupyter-core" in _requirement_names(metadata.requires(script.dist.name) or [])
    # Run it as typed (the jupyter of this environment, a kernel of this interpreter), from the clone's root.
    env = {**kernel_env(tmp_path), "PYTHONPATH": str(REPO)}
    jupyter = Path(sys.executable).parent / "jupyter"
    started = time.monotonic()
    done = subprocess.run([str(jupyter), *words[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    assert any((tmp_path / "01-quickstart").glob("**/checkpoint-*")), "the notebook's run trained and saved"
    print(f"\n{command}: {time.monotonic() - started:.0f} s")


def test_the_demo_says_it_trains_after_its_first_step(tmp_path):
    out = tmp_path / "demo"
    started = time.monotonic()
    run = start_workbench("run", REPO / "examples" / "tiny-gpt.toml", "--headless", "--overwrite",
                          "--set", f"training.output_dir={out}", "--set", "training.max_steps=30", cwd=tmp_path)
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("training: step 1/30 took "))
    assert lines[first].endswith("a progress line every 25 steps"), lines[first]
    assert lines[0].startswith("eval @ step 0:") and first == 1, lines[:3]  # nothing waits for step 25
    assert lines[first + 1].startswith("step 25/30 |")
    print(f"\nthe demo (30 steps): {time.monotonic() - started:.1f} s")


def test_a_busy_output_dir_is_said_first_and_overwrite_says_what_it_deleted(tmp_path):
    out = tmp_path / "out"
    with headless_run(tmp_path) as live:
        saved = workbench("ctl", out, "save", cwd=tmp_path)
        assert saved.returncode == 0 and saved.stdout.startswith("saved: checkpoint-"), saved
        for extra in ((), ("--resume",), ("--overwrite",)):
            second = workbench("run", "run.toml", "--headless", *extra, cwd=tmp_path)
            assert second.returncode == 2, second.stderr
            assert f"is in use by another run (pid {live.pid} on " in second.stderr, second.stderr
            assert "already holds checkpoints" not in second.stderr
        stopped = workbench("ctl", out, "stop", cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
        live.communicate(timeout=120)
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert len(names) == 2
    over = workbench("run", "run.toml", "--headless", "--overwrite", "--set", "training.max_steps=3", cwd=tmp_path)
    assert over.returncode == 0, over.stderr
    told = [line for line in over.stderr.splitlines() if "--overwrite deleted" in line]
    assert told == [f"workbench: --overwrite deleted from {out}: {', '.join(names)}, events.jsonl"], over.stderr


def test_a_stop_from_an_attached_client_is_told_in_the_runs_output_and_its_end(tmp_path):
    out = tmp_path / "out"
    with headless_run(tmp_path) as live:
        remote = attach(out, client="attach")  # as `workbench attach` connects
        try:
            remote.pause(wait=True, timeout=60)
            time.sleep(1.2)
            status = workbench("ctl", out, "status", cwd=tmp_path)  # the elapsed clock leaves the pause out
            assert re.search(r"^ctl: paused, step \d+/100000, .*elapsed 0:00:\d\d \(paused 0:00:0[1-9]\)$",
                             status.stdout, re.M), status.stdout
            remote.resume()
            remote.stop(save=True)
        finally:
            remote.close()
        _, stderr = live.communicate(timeout=120)
    assert live.returncode == 0, stderr
    by = "from an attached dashboard (workbench attach)"
    told = [line for line in stderr.splitlines() if by in line]
    assert [line.split(" at step ")[0] for line in told] == [
        f"workbench: paused {by}", f"workbench: resumed {by}", f"workbench: stopping {by}", f"workbench: stopped {by}"]
    end = read_events(out)[-1]
    assert (end["event"], end["stop_reason"], end["exit_code"]) == ("end", "attach", 0)
    watched = workbench("watch", out, cwd=tmp_path)
    assert f"stopped {by} at step {end['step']}" in watched.stdout.splitlines()[0], watched.stdout
