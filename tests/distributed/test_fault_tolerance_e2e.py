"""Fault tolerance on real processes: SIGKILL at random moments, SIGTERM (JIT checkpoint), Ctrl-C.

Every test here starts ``workbench run`` as a real subprocess and signals it from outside,
the way a scheduler or a user would. Nothing is mocked. The claims checked:

* SIGKILL anywhere (start-up, a step, the middle of a save, the middle of a rotation) never
  leaves the output directory in a state that ``--resume`` cannot continue from without
  manual cleanup, and the run resumed over and over ends with weights bitwise equal to an
  uninterrupted run of the same config.
* With ``training.enable_jit_checkpoint = true`` SIGTERM finishes the current step (or the
  current evaluation batch), saves a verified checkpoint at that step, and exits 143; a
  second SIGTERM does not start a second save; resuming is bitwise identical.
* Ctrl-C (SIGINT) does the same save-and-stop and exits 130.
* Without the opt-in, SIGTERM terminates the process as usual and saves nothing.

Run with ``pytest -s`` to see how many kill rounds ran and where they landed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w
import torch

from workbench.checkpoint.store import SENTINEL, CheckpointStore
from workbench.core.event_file import read_events

from support import assert_same_weights
from support.launched import EventTail, Run, final_weights, launch, run_to_completion

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


# -- configs -------------------------------------------------------------------------------------

TINY_MODEL = {"builtin": "tiny-gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 32}}

# Saves every 2 steps into a limit of 2: with a model this small a save (hashing, fsync,
# rename, rotation) takes longer than a step, so random kills often land inside one.
FAULT_CONFIG = {
    "run_name": "fault",
    "model": TINY_MODEL,
    "data": {"builtin": "python-source", "options": {"block_size": 32, "max_chars": 20000}},
    "training": {
        "max_steps": 40,
        "per_device_train_batch_size": 8,
        "learning_rate": 3e-3,
        "logging_steps": 5,
        "save_strategy": "steps",
        "save_steps": 2,  # max_steps is a multiple: the final step is saved too
        "save_total_limit": 2,
        "seed": 42,
    },
}

# Long enough that a signal sent after the first log line lands mid-run. Half of the text
# is the eval split so that the evaluation test below has many eval blocks; the training
# config is the same in every SIGTERM / SIGINT test, so they share one uninterrupted run.
SIGNAL_CONFIG = {
    "run_name": "signals",
    "model": TINY_MODEL,
    "data": {"builtin": "python-source", "options": {"block_size": 32, "max_chars": 256000, "eval_fraction": 0.5}},
    "training": {
        "max_steps": 150,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 1,
        "learning_rate": 3e-3,
        "logging_steps": 5,
        "save_strategy": "steps",
        "save_steps": 50,
        "save_total_limit": 2,
        "seed": 7,
    },
}


def merged(base: dict, **sections: dict) -> dict:
    """``base`` with the given sections' keys replaced (one level deep)."""
    out = json.loads(json.dumps(base))
    for name, values in sections.items():
        out.setdefault(name, {}).update(values)
    return out


def write_config(directory: Path, config: dict, output_dir: Path, name: str = "config.toml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = merged(config, training={"output_dir": str(output_dir)})
    path = directory / name
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


# -- processes -----------------------------------------------------------------------------------


def checkpoint_dirs(output_dir: Path) -> list[str]:
    return sorted(p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")) if output_dir.is_dir() else []


# -- 1. SIGKILL at random moments, resume each time ------------------------------------------------


@dataclass
class KillStats:
    launches: int = 0
    kills: int = 0
    startup_kills: int = 0
    in_save: int = 0  # a .tmp-checkpoint-* was left behind: killed while a checkpoint was written
    in_rotation: int = 0  # a .trash-* was left behind: killed while an old checkpoint was deleted
    finished_runs: int = 0
    landed: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{self.kills} SIGKILL rounds ({self.startup_kills} timed from launch, mostly in start-up), {self.launches} launches, "
                f"{self.in_save} landed while a checkpoint was being written, {self.in_rotation} during a rotation "
                f"delete; {self.finished_runs} resumed chains compared bitwise with the uninterrupted run")


def save_in_flight(out: Path, run: Run, timeout: float) -> bool:
    """Return as soon as ``out`` holds a checkpoint being written (``.tmp-checkpoint-*``), or
    False after ``timeout`` seconds or once the run has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        with os.scandir(out) as entries:
            if any(entry.name.startswith(".tmp-checkpoint-") for entry in entries):
                return True
        time.sleep(0.0005)
    return False


def kill_campaigns(tmp_path: Path, kills_wanted: int, seed: int, save_async: bool = False) -> KillStats:
    rng = random.Random(seed)
    config = merged(FAULT_CONFIG, training={"save_async": True}) if save_async else FAULT_CONFIG
    max_steps, limit = config["training"]["max_steps"], config["training"]["save_total_limit"]
    logs = tmp_path / "logs"

    # The uninterrupted run, in parallel with the first rounds (it only has to finish by the end).
    ref_out = tmp_path / "reference"
    reference = launch(write_config(tmp_path / "ref-config", config, ref_out), logs=logs, tag="reference")

    stats = KillStats()
    save_gaps: list[float] = []  # seconds between consecutive save events, to scale the random delays
    campaign = 0
    while stats.kills < kills_wanted:
        campaign += 1
        out = tmp_path / f"chain-{campaign}"
        cfg = write_config(tmp_path / f"config-{campaign}", config, out)
        best_step_so_far = 0
        while True:
            # What --resume must pick: the newest checkpoint that verifies (0: start fresh).
            store = CheckpointStore(out)
            latest = store.latest_verified()
            expected_start = latest.step if latest else 0
            assert expected_start >= best_step_so_far, "a verified checkpoint was lost"
            best_step_so_far = expected_start

            tail = EventTail(out)
            stats.launches += 1
            tag = f"chain{campaign}-launch{stats.launches}"
            run = launch(cfg, "--resume", logs=logs, tag=tag)
            last_round = stats.kills >= kills_wanted
            if last_round:
                code = run.wait()
                assert code == 0, f"{tag}: the final resume failed (exit {code}):\n{run.stderr}"
                break

            if rng.random() < 0.12:
                # Start-up: imports, building the model, loading the checkpoint, cleaning leftovers.
                time.sleep(rng.uniform(0.2, 3.0))
                phase = "startup"
            else:
                start = tail.wait_for(run, lambda e: e.get("event") == "start")
                if start is None:
                    code = run.wait()
                    assert code == 0, f"{tag}: exit {code} before training started:\n{run.stderr}"
                    break
                assert start["step"] == expected_start, (
                    f"{tag}: resumed at step {start['step']}, the newest verified checkpoint is step {expected_start}")
                # Let 0-2 more saves complete, then stop at a random point of the next save period.
                saves_to_wait = rng.choice([0, 0, 1, 1, 2])
                last_seen = time.monotonic()
                exited = False
                for _ in range(saves_to_wait):
                    event = tail.wait_for(run, lambda e: e.get("event") == "save")
                    if event is None:
                        exited = True
                        break
                    now = time.monotonic()
                    save_gaps.append(now - last_seen)
                    last_seen = now
                if exited:
                    code = run.wait()
                    assert code == 0, f"{tag}: exit {code}:\n{run.stderr}"
                    break
                gap = statistics.median(save_gaps[-20:]) if save_gaps else 0.1
                if rng.random() < 0.3:
                    # Aimed: the moment a checkpoint is being written (a save lasts milliseconds
                    # here, so random moments alone hit one too rarely to rely on).
                    save_in_flight(out, run, timeout=1.3 * gap + 2.0)
                else:
                    time.sleep(rng.uniform(0.0, 1.3 * gap))
                phase = "training"

            if run.proc.poll() is not None:  # it finished (or failed) before the kill
                code = run.wait()
                assert code == 0, f"{tag}: exit {code}:\n{run.stderr}"
                break
            run.proc.send_signal(signal.SIGKILL)
            code = run.wait()
            if code == 0:  # finished in the same instant
                break
            assert code == -signal.SIGKILL, f"{tag}: exit {code} instead of being killed:\n{run.stderr}"
            stats.kills += 1
            stats.startup_kills += phase == "startup"

            # Where did it land? Leftovers show a save or a delete cut short.
            names = [p.name for p in out.iterdir()] if out.is_dir() else []
            if any(n.startswith(".tmp-checkpoint-") for n in names):
                stats.in_save += 1
            if any(n.startswith(".trash-") for n in names):
                stats.in_rotation += 1
            # Whatever was published is whole: every manifest verifies, and rotation never
            # keeps more than the limit plus the one just published before it could delete.
            for info in store.list():
                if info.complete:
                    ok, why = store.verify(info.path)
                    assert ok, f"after {tag}: published {info.name} does not verify: {why}"
            assert sum(c.complete for c in store.list()) <= limit + 1, checkpoint_dirs(out)

        # The chain ended with a successful run: same final weights as the uninterrupted run.
        stats.finished_runs += 1
        events = read_events(out)
        assert events[-1]["event"] == "end" and events[-1]["step"] == max_steps, events[-1]
        assert not [p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".trash-"))], list(out.iterdir())
        code = reference.wait()
        assert code == 0, f"reference run failed:\n{reference.stderr}"
        expected = final_weights(ref_out, max_steps)
        assert_same_weights(final_weights(out, max_steps), expected, f"chain {campaign}")
    print(f"\n[fault test] {stats.summary()}")
    return stats


def test_sigkill_at_random_moments_then_resume_matches_uninterrupted(tmp_path):
    stats = kill_campaigns(tmp_path, kills_wanted=20, seed=20240601)
    assert stats.kills >= 20
    assert stats.kills - stats.startup_kills >= 12  # most kills land in training / saving
    assert stats.in_save >= 3, stats.summary()


def test_sigkill_with_background_saves_then_resume_matches_uninterrupted(tmp_path):
    # save_async: kills also land while the writer thread hashes and publishes.
    stats = kill_campaigns(tmp_path, kills_wanted=12, seed=7, save_async=True)
    assert stats.kills >= 12
    assert stats.in_save >= 2, stats.summary()


def test_sigkill_at_random_moments_many_rounds(tmp_path):
    stats = kill_campaigns(tmp_path, kills_wanted=60, seed=99)
    assert stats.kills >= 60
    assert stats.in_save >= 10, stats.summary()


# -- shared: the uninterrupted run of SIGNAL_CONFIG --------------------------------------------------


@pytest.fixture(scope="module")
def signal_reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    base = tmp_path_factory.mktemp("signal-reference")
    out = base / "out"
    run_to_completion(write_config(base, SIGNAL_CONFIG, out), out, base / "logs", "reference")
    return final_weights(out, SIGNAL_CONFIG["training"]["max_steps"])


def start_and_wait_for_training(config: Path, out: Path, logs: Path, tag: str, *extra: str) -> tuple[Run, EventTail]:
    tail = EventTail(out)
    run = launch(config, *extra, logs=logs, tag=tag)
    first_log = tail.wait_for(run, lambda e: e.get("event") == "log")
    assert first_log is not None, f"{tag}: exit {run.proc.returncode} before the first log line:\n{run.stderr}"
    return run, tail


def assert_stopped_with_checkpoint(out: Path, run: Run, code: int, expected_code: int, reason: str) -> int:
    """The run stopped with ``expected_code`` and a verified checkpoint at the step it reports."""
    assert code == expected_code, f"exit {code}, expected {expected_code}:\n{run.stderr}"
    events = read_events(out)
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "stopped", end
    step = end["step"]
    assert 0 <= step < SIGNAL_CONFIG["training"]["max_steps"]
    saves = [e for e in events if e["event"] == "save"]
    assert saves and saves[-1]["step"] == step, (saves[-1:], end)
    latest = CheckpointStore(out).latest_verified()
    assert latest is not None and latest.step == step, (latest, step)
    assert not (Path(latest.path) / SENTINEL).exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert f"{reason} at step {step}" in run.stderr, run.stderr
    return step


# -- 2. real SIGTERM with the JIT checkpoint -------------------------------------------------------


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_sigterm_saves_verified_checkpoint_and_resume_is_bitwise(tmp_path, signal_reference, save_async):
    out = tmp_path / "out"
    training = {"enable_jit_checkpoint": True, "save_async": save_async}
    config = write_config(tmp_path, merged(SIGNAL_CONFIG, training=training), out)
    run, _ = start_and_wait_for_training(config, out, tmp_path / "logs", "sigterm")
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait()
    step = assert_stopped_with_checkpoint(out, run, code, 143, "stopped by SIGTERM")
    assert step > 0

    resumed = run_to_completion(config, out, tmp_path / "logs", "resume", "--resume")
    starts = [e for e in read_events(out) if e["event"] == "start"]
    assert starts[-1]["step"] == step, (starts, resumed.stderr)
    assert_same_weights(final_weights(out, SIGNAL_CONFIG["training"]["max_steps"]), signal_reference,
                        "SIGTERM + resume")


# -- 3. SIGTERM while evaluating --------------------------------------------------------------------


def test_sigterm_during_evaluation_stops_within_the_evaluation(tmp_path, signal_reference):
    # eval_on_start over ~4000 eval blocks one at a time: the first seconds are all evaluation.
    # (eval_steps beyond max_steps: no other evaluation, so the training matches the reference.)
    out = tmp_path / "out"
    config = write_config(tmp_path, merged(SIGNAL_CONFIG, training={
        "enable_jit_checkpoint": True, "eval_on_start": True, "eval_strategy": "steps", "eval_steps": 1000}), out)
    tail = EventTail(out)
    run = launch(config, logs=tmp_path / "logs", tag="eval-sigterm")
    start = tail.wait_for(run, lambda e: e.get("event") == "start")
    assert start is not None, run.stderr
    time.sleep(0.7)
    tail.poll()
    assert not [e for e in tail.events if e["event"] in ("log", "eval")], (
        "the evaluation at start finished within 0.7 s; make the eval set larger", tail.events)
    started = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait()
    reaction = time.monotonic() - started
    step = assert_stopped_with_checkpoint(out, run, code, 143, "stopped by SIGTERM")
    assert step == 0
    evals = [e for e in read_events(out) if e["event"] == "eval"]
    assert len(evals) == 1 and evals[0]["step"] == 0 and evals[0].get("eval_interrupted") is True, evals
    assert reaction < 30, reaction  # it did not first finish the whole evaluation... nor hang

    # Resuming runs the start evaluation again (in full this time) and trains to the end; an
    # evaluation touches no random state, so the weights equal the run without it.
    run_to_completion(config, out, tmp_path / "logs", "eval-resume", "--resume")
    evals = [e for e in read_events(out) if e["event"] == "eval"]
    at_start = [e for e in evals if e["step"] == 0]
    assert len(at_start) == 2 and "eval_interrupted" not in at_start[-1] and "eval_loss" in at_start[-1], evals
    # ... and, as in HF, the last step (not an eval step) evaluates at the end.
    assert evals[-1]["step"] == SIGNAL_CONFIG["training"]["max_steps"], evals
    assert_same_weights(final_weights(out, SIGNAL_CONFIG["training"]["max_steps"]), signal_reference,
                        "SIGTERM during evaluation + resume")


# -- 4. a second SIGTERM during the save --------------------------------------------------------------


def test_second_sigterm_during_the_save_does_not_start_a_second_save(tmp_path):
    # A wider model makes the JIT save long enough to signal again while it runs; no periodic
    # saves, so any .tmp-checkpoint-* folder is the JIT save in progress.
    out = tmp_path / "out"
    config = write_config(tmp_path, merged(SIGNAL_CONFIG, model={"options": {"n_layer": 2, "n_head": 4, "n_embd": 256}},
                                           training={"enable_jit_checkpoint": True, "save_strategy": "no",
                                                     "max_steps": 1000}), out)
    run, _ = start_and_wait_for_training(config, out, tmp_path / "logs", "double-sigterm")
    run.proc.send_signal(signal.SIGTERM)
    second_sent_during_save = False
    deadline = time.monotonic() + 60
    while run.proc.poll() is None and time.monotonic() < deadline:
        if any(out.glob(f".tmp-checkpoint-*/{SENTINEL}")):
            run.proc.send_signal(signal.SIGTERM)
            second_sent_during_save = True
            break
        time.sleep(0.001)
    code = run.wait()
    assert second_sent_during_save, f"the save finished before the second SIGTERM could be sent (exit {code})"
    assert code == 143, f"exit {code}:\n{run.stderr}"
    events = read_events(out)
    saves = [e for e in events if e["event"] == "save"]
    step = events[-1]["step"]
    assert len(saves) == 1 and saves[0]["step"] == step, saves
    assert checkpoint_dirs(out) == [f"checkpoint-{step}"]
    latest = CheckpointStore(out).latest_verified()
    assert latest is not None and latest.step == step
    assert run.stderr.count("stopped by SIGTERM") == 1, run.stderr


# -- 5. Ctrl-C ------------------------------------------------------------------------------------------


def test_ctrl_c_saves_exits_130_and_resume_continues(tmp_path, signal_reference):
    out = tmp_path / "out"
    config = write_config(tmp_path, SIGNAL_CONFIG, out)  # no enable_jit_checkpoint: Ctrl-C is the CLI's
    run, _ = start_and_wait_for_training(config, out, tmp_path / "logs", "ctrl-c")
    run.proc.send_signal(signal.SIGINT)
    code = run.wait()
    step = assert_stopped_with_checkpoint(out, run, code, 130, "stopped by Ctrl-C")  # door/endings.py's words
    assert "Traceback" not in run.stderr

    run_to_completion(config, out, tmp_path / "logs", "ctrl-c-resume", "--resume")
    starts = [e for e in read_events(out) if e["event"] == "start"]
    assert starts[-1]["step"] == step
    assert_same_weights(final_weights(out, SIGNAL_CONFIG["training"]["max_steps"]), signal_reference,
                        "Ctrl-C + resume")


# -- 6. without the opt-in ----------------------------------------------------------------------------


def test_sigterm_without_jit_checkpoint_just_terminates(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path, merged(SIGNAL_CONFIG, training={"save_strategy": "no", "max_steps": 1000}), out)
    run, _ = start_and_wait_for_training(config, out, tmp_path / "logs", "plain-sigterm")
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait()
    assert code in (-signal.SIGTERM, 143), f"exit {code}:\n{run.stderr}"
    events = read_events(out)
    assert not [e for e in events if e["event"] in ("save", "end")], events[-3:]
    assert checkpoint_dirs(out) == []
    assert CheckpointStore(out).latest_verified() is None
