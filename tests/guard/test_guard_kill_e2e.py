"""SIGKILL and resume across the guard's interventions, the way a user runs it (issue #18).

Everything here goes through the user's path: ``workbench run CONFIG --headless`` as a real
subprocess, a model from the user's own module (``[model] factory``, on PYTHONPATH), the
user's jsonl file loaded through ``[data]`` (the ``datasets`` library), a ``[guard]``
table, and a real ``os.kill(pid, SIGKILL)``. Three rows of the file are poisoned: two have a
regression target of 1e30 (their squared error overflows float32: a non-finite loss, which
is skipped) and one a target of 300 (a loss thousands of times the running median: a spike,
which is rolled back). With the seeded order they land at steps 14 (skip), 19 (rollback to
the save at 18, past the spike's batch) and, after the rollback, 23 (skip). Saves (every 3
steps) and snapshots (every 4) do not line up, as they need not in a user's config.

Each test kills the run at a different point around the interventions, resumes it with
``--resume`` and checks: the final weights are bitwise equal to the uninterrupted run's, the
resumed process records the same guard events as the uninterrupted run did from that
checkpoint on (steps, kinds, actions, sample ids, rollback details), the final checkpoint
keeps the same intervention history, and the killed run's events.jsonl shows what it did.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

import pytest

from workbench.core.event_file import read_events

from support import assert_same_weights, wait_until
from support.launched import EventTail, Run, final_weights, launch, run_to_completion

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# The user's model module. The GUARD_TEST_* variables only pace the killed process (a sleep
# changes no number): DELAY seconds per forward, so a kill sent right after an event lands
# before the run ends; MARK: after a forward whose labels hold MARK_LABEL, the next forward
# touches MARK and sleeps, so the test can kill inside the steps between a bad step and the
# point where the guard reads it.
MODEL_MODULE = '''
import os
import time
from pathlib import Path

import torch
from torch import nn

_after_marked = False


class Linear(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, 1)

    def forward(self, x, labels=None):
        _pace(labels)
        out = self.lin(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def _pace(labels):
    global _after_marked
    mark = os.environ.get("GUARD_TEST_MARK")
    if mark and _after_marked:
        Path(mark).touch()
        time.sleep(60)
    if mark and labels is not None:
        _after_marked = bool((labels == float(os.environ["GUARD_TEST_MARK_LABEL"])).any())
    time.sleep(float(os.environ.get("GUARD_TEST_DELAY", "0")))


def build(dim=4):
    return Linear(dim)
'''

ROWS, BATCH, MAX_STEPS = 96, 4, 24
NONFINITE_ROWS, SPIKE_ROW, SPIKE_LABEL = (40, 72), 10, 300.0

CONFIG = {
    "run_name": "guarded",
    "model": {"factory": "guardmodel:build", "options": {"dim": 4}},
    "data": {"train": {"path": "train.jsonl"}},
    "training": {
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": BATCH,
        "learning_rate": 0.05,
        "logging_steps": 2,
        "save_strategy": "steps",
        "save_steps": 3,
        "seed": 5,
        "report_to": ["jsonl"],
    },
    "guard": {"nonfinite": "skip", "spike": "rollback", "spike_factor": 10.0, "window": 4, "snapshot_every": 4},
}

# Where the poisoned rows land with seed 5 (checked on the reference run).
EXPECTED = [(14, "nonfinite", "skip", 40), (19, "spike", "rollback", SPIKE_ROW), (23, "nonfinite", "skip", 72)]
PACED = {"GUARD_TEST_DELAY": "0.1"}  # 24 steps: ~2.4 s more for the killed process only


def write_user_files(folder: Path) -> None:
    """The user's module and jsonl file (a noiseless linear target, three rows poisoned)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "guardmodel.py").write_text(MODEL_MODULE, encoding="utf-8")
    rng, w = random.Random(0), [0.5, -1.0, 2.0, 0.25]
    rows = []
    for _ in range(ROWS):
        x = [round(rng.gauss(0, 1), 4) for _ in w]
        rows.append({"x": x, "labels": round(sum(a * b for a, b in zip(x, w)), 4)})
    for i in NONFINITE_ROWS:
        rows[i]["labels"] = 1e30
    rows[SPIKE_ROW]["labels"] = SPIKE_LABEL
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_run_config(folder: Path, name: str) -> tuple[Path, Path]:
    """``folder/NAME.toml`` with its own output folder; returns (config, output_dir)."""
    import tomli_w

    out = folder / f"out-{name}"
    data = json.loads(json.dumps(CONFIG))
    data["training"]["output_dir"] = out.name  # relative: resolved against the config's folder
    path = folder / f"{name}.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path, out


def guard_events(events: list[dict]) -> list[dict]:
    """The guard records, without their wall-clock time."""
    return [{k: v for k, v in e.items() if k != "time"} for e in events if e.get("event") == "guard"]


def same_action(records: list[dict]) -> list[dict]:
    """What must repeat exactly after a resume: all of a record but ``source``. A rollback the
    uninterrupted run takes from its in-memory snapshot of a save, a run resumed from that
    save takes from the checkpoint on disk: the same state, another source."""
    return [{k: v for k, v in r.items() if k != "source"} for r in records]


def checkpoint_interventions(out: Path, step: int) -> list[dict]:
    state = json.loads((out / f"checkpoint-{step}" / "workbench_state.json").read_text(encoding="utf-8"))
    return state["guard"]["interventions"]


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict:
    """The user's folder and the uninterrupted reference run of CONFIG."""
    folder = tmp_path_factory.mktemp("user")
    write_user_files(folder)
    config, out = write_run_config(folder, "reference")
    run_to_completion(config, out, folder / "logs", "reference", pythonpath=(folder,))
    events = guard_events(read_events(out))
    found = [(e["step"], e["kind"], e["action"]) for e in events]
    assert found == [x[:3] for x in EXPECTED], found
    assert all(row in e["samples"] for e, (*_, row) in zip(events, EXPECTED)), events
    assert SPIKE_ROW in events[1]["skipped_samples"] and events[1]["restored_step"] == 18, events[1]
    return {"folder": folder, "events": events, "weights": final_weights(out, MAX_STEPS),
            "interventions": checkpoint_interventions(out, MAX_STEPS)}


def start(user: dict, name: str, env: dict[str, str]) -> tuple[Path, Path, Run, EventTail]:
    config, out = write_run_config(user["folder"], name)
    tail = EventTail(out)
    run = launch(config, logs=user["folder"] / "logs", tag=name, env=env, pythonpath=(user["folder"],))
    return config, out, run, tail


def wait_event(run: Run, tail: EventTail, what: str, predicate) -> dict:
    event = tail.wait_for(run, predicate)
    assert event is not None, f"the run ended (exit {run.proc.returncode}) before {what}:\n{run.stderr}"
    return event


def sigkill(run: Run) -> None:
    os.kill(run.proc.pid, signal.SIGKILL)
    code = run.wait()
    assert code == -signal.SIGKILL, f"exit {code} instead of being killed:\n{run.stderr}"


def resume_and_compare(user: dict, config: Path, out: Path, name: str) -> int:
    """Resume the killed run to the end; check it against the reference. Returns the resumed step."""
    tail = EventTail(out)
    run_to_completion(config, out, user["folder"] / "logs", f"{name}-resume", "--resume",
                      pythonpath=(user["folder"],))
    resumed = tail.poll()
    first = resumed[0]
    assert first["event"] == "start", first
    step = first["step"]
    # The resumed process records exactly what the uninterrupted run recorded after that checkpoint.
    known = len(checkpoint_interventions(out, step))
    assert same_action(guard_events(resumed)) == same_action(user["events"][known:])
    assert same_action(checkpoint_interventions(out, MAX_STEPS)) == same_action(user["interventions"])
    assert_same_weights(final_weights(out, MAX_STEPS), user["weights"], f"{name}: SIGKILL + resume")
    return step


def test_sigkill_after_a_skip_then_resume_is_bitwise(user):
    config, out, run, tail = start(user, "after-skip", PACED)
    wait_event(run, tail, "the skip", lambda e: e.get("event") == "guard")
    wait_event(run, tail, "a save after the skip", lambda e: e.get("event") == "save")
    sigkill(run)
    killed = guard_events(read_events(out))
    assert [(e["step"], e["kind"], e["action"]) for e in killed] == [(14, "nonfinite", "skip")], killed
    assert 40 in killed[0]["samples"]
    step = resume_and_compare(user, config, out, "after-skip")
    assert step == 15, f"killed after the save at 15, yet resumed at {step}"


def test_sigkill_after_a_rollback_then_resume_is_bitwise(user):
    config, out, run, tail = start(user, "after-rollback", PACED)
    wait_event(run, tail, "the rollback", lambda e: e.get("event") == "guard" and e["action"] == "rollback")
    wait_event(run, tail, "a save after the rollback", lambda e: e.get("event") == "save")
    sigkill(run)
    killed = guard_events(read_events(out))
    assert [(e["step"], e["action"]) for e in killed][:2] == [(14, "skip"), (19, "rollback")], killed
    assert killed[1]["skipped_samples"] == user["events"][1]["skipped_samples"]
    # Resumed from the save after the rollback (its steps count from the restored snapshot).
    step = resume_and_compare(user, config, out, "after-rollback")
    assert step == 21 and len(checkpoint_interventions(out, step)) == 2, step


def test_sigkill_between_a_spike_and_its_rollback_then_resume_is_bitwise(user, tmp_path):
    # The spike's step has run (its update masked on the device) but the guard has not read
    # the flags yet: the step after it pauses in forward, and is killed there.
    mark = tmp_path / "after-spike"
    env = {**PACED, "GUARD_TEST_MARK": str(mark), "GUARD_TEST_MARK_LABEL": str(SPIKE_LABEL)}
    config, out, run, tail = start(user, "before-rollback", env)
    wait_until(lambda: mark.exists() or run.proc.poll() is not None, "the step after the spike", 120, every=0.01)
    assert run.proc.poll() is None, f"exit {run.proc.returncode} before the step after the spike:\n{run.stderr}"
    sigkill(run)
    killed = guard_events(read_events(out))
    assert [(e["step"], e["action"]) for e in killed] == [(14, "skip")], killed  # the rollback was not decided
    step = resume_and_compare(user, config, out, "before-rollback")
    assert step == 18, step
    # resumed between a snapshot (16) and the spike: the ring is empty, the checkpoint serves
    rollback = guard_events(read_events(out))[-2]
    assert (rollback["action"], rollback["restored_step"], rollback["source"]) == ("rollback", 18, "checkpoint")
