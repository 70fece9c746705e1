"""Hangs and stragglers on real processes: ``workbench run`` on one process and on 2 CPU ranks
(``--num-processes 2``), with a rank made to sleep in its data loader, one stuck before a
collective, and one 3x slower. The hang is reported within ``hang_timeout`` + 10 s of the
stall (by the stalled rank's own clock) naming the right rank and phase, every rank's stacks
are dumped, ``hang_action = "stop"`` exits 3, and ``--resume`` continues; the straggler is named
within 30 s, and ``ctl status`` shows each rank's work per step against the other's."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from support.processes import workbench

TIMEOUT = 3.0
CONFIG = """\
[model]
builtin = "mlp"
[model.options]
in_features = 8
hidden = 16
num_classes = 3
[data]
builtin = "random-classification"
[data.options]
n_train = 4096
n_eval = 32
in_features = 8
num_classes = 3
[training]
output_dir = "out"
max_steps = {max_steps}
per_device_train_batch_size = 8
save_steps = 4
logging_steps = 2
report_to = "jsonl"
disable_tqdm = true
[hooks]
data_collator = "slow:collate"
callbacks = ["slow:StuckBeforeCollective"]
[health]
hang_timeout = {timeout}
hang_action = "{action}"
straggler_factor = 2.0
straggler_after = 3.0
"""
# What each rank does, by WB_TEST_MODE: hang in its data loader, stop before the optimizer's
# step (ahead of the ranks' next collective), or take three times as long over its batches.
SLOW_PY = """\
import os, time
from torch.utils.data import default_collate
from workbench import TrainerCallback

MODE = os.environ.get("WB_TEST_MODE", "")
RANK = int(os.environ.get("RANK", "0"))
calls = 0


def collate(rows):
    global calls
    calls += 1
    if MODE == "hang-data" and RANK == int(os.environ.get("WB_HANG_RANK", "1")) and calls == 7:
        time.sleep(3600)
    if MODE == "straggle":
        time.sleep(0.06 if RANK == 1 else 0.02)
    return default_collate(rows)


class StuckBeforeCollective(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if MODE == "hang-collective" and RANK == 1 and state.global_step == 5:
            with open("stalled-at", "w") as f:  # when the stall began, for the test to time the report
                f.write(repr(time.time()))
            time.sleep(3600)
"""


def _project(tmp_path: Path, max_steps: int = 12, action: str = "stop", timeout: float = TIMEOUT) -> Path:
    (tmp_path / "slow.py").write_text(SLOW_PY)
    (tmp_path / "run.toml").write_text(CONFIG.format(max_steps=max_steps, timeout=timeout, action=action))
    return tmp_path


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def _hang(tmp_path: Path, mode: str, *extra: str, hang_rank: int = 1) -> tuple[dict, float]:
    started = time.monotonic()
    done = workbench("run", "run.toml", "--headless", *extra, cwd=tmp_path, timeout=240,
                     env={"WB_TEST_MODE": mode, "WB_HANG_RANK": str(hang_rank)})
    took = time.monotonic() - started
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    hangs = [e for e in _events(tmp_path / "out") if e["event"] == "hang"]
    assert len(hangs) == 1, done.stderr[-3000:]
    assert "workbench: hang: rank" in done.stderr and "exit code 3" in done.stderr
    return hangs[0], took


def _resumes(tmp_path: Path, *extra: str) -> None:
    resumed = workbench("run", "run.toml", "--headless", "--resume", *extra, cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _events(tmp_path / "out")[-1]["event"] == "end"


def test_one_process_stuck_in_its_data_stops_with_exit_3_and_resumes(tmp_path):
    _project(tmp_path)
    hang, took = _hang(tmp_path, "hang-data", hang_rank=0)
    assert hang["rank"] == 0 and hang["phase"] == "data" and hang["seconds"] <= TIMEOUT + 10
    folder = Path(hang["folder"])
    assert [p.name for p in folder.iterdir()] == ["rank-0.txt"] and "slow.py" in (folder / "rank-0.txt").read_text()
    assert took < 120
    _resumes(tmp_path)


def test_two_ranks_one_asleep_in_its_data_loader(tmp_path):
    _project(tmp_path)
    hang, _ = _hang(tmp_path, "hang-data", "--num-processes", "2")
    assert hang["rank"] == 1 and hang["phase"] == "data" and hang["seconds"] <= TIMEOUT + 10
    folder = Path(hang["folder"])
    assert sorted(p.name for p in folder.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert "in collate" in (folder / "rank-1.txt").read_text()
    _resumes(tmp_path, "--num-processes", "2")


def test_two_ranks_one_stuck_before_a_collective(tmp_path):
    _project(tmp_path)
    hang, _ = _hang(tmp_path, "hang-collective", "--num-processes", "2")
    # rank 1 stands before the optimizer step of step 6 (5 done); rank 0 waits in a collective
    assert hang["rank"] == 1 and hang["phase"] == "optimizer" and hang["stalled_step"] == 5
    assert hang["ranks"]["0"]["step"] >= 5 and hang["ranks"]["0"]["phase"] in ("backward", "collective")
    folder = Path(hang["folder"])
    assert sorted(p.name for p in folder.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    # reported, and every rank's stacks written, within hang_timeout + 10 s of the stall
    stalled_at = float((tmp_path / "stalled-at").read_text())
    assert TIMEOUT - 0.5 <= hang["time"] - stalled_at <= TIMEOUT + 10 and hang["seconds"] <= TIMEOUT + 10
    assert max(p.stat().st_mtime for p in folder.iterdir()) - stalled_at <= TIMEOUT + 10
    _resumes(tmp_path, "--num-processes", "2")


def test_a_rank_three_times_slower_is_named_a_straggler(tmp_path):
    from support.processes import start_workbench

    _project(tmp_path, max_steps=400, action="report", timeout=60)
    started = time.monotonic()
    out = tmp_path / "out"
    run = start_workbench("run", "run.toml", "--headless", "--num-processes", "2", cwd=tmp_path,
                          env={"WB_TEST_MODE": "straggle"})
    try:
        while not (out / "events.jsonl").exists() or not any(e["event"] == "straggler" for e in _events(out)):
            assert run.poll() is None and time.monotonic() - started < 120, run.communicate()[1][-3000:]
            time.sleep(0.2)
        # live, while it runs: each rank's own work per step against the other's
        status = workbench("ctl", "out", "status", cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        line = next(line for line in status.stdout.splitlines() if line.startswith("work a step by rank"))
        factors = dict(re.findall(r"(\d) [\d.]+ ms ([\d.]+)x", line))
        assert float(factors["1"]) > 2 and float(factors["0"]) < 0.6, line
        assert run.wait(timeout=300) == 0, run.communicate()[1][-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    events = _events(out)
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert [e["rank"] for e in stragglers] == [1], [e["event"] for e in events]
    first = min(e["time"] for e in events if e["event"] == "start")
    assert stragglers[0]["time"] - first < 30 and stragglers[0]["factor"] > 2
    assert time.monotonic() - started < 300


def test_two_ranks_book_their_time_and_the_end_record_carries_it(tmp_path):
    _project(tmp_path, max_steps=40, action="report", timeout=60)
    toml = (tmp_path / "run.toml").read_text().replace("[hooks]", 'eval_strategy = "steps"\neval_steps = 10\n'
                                                       "per_device_eval_batch_size = 8\n[hooks]")
    (tmp_path / "run.toml").write_text(toml)
    done = workbench("run", "run.toml", "--headless", "--num-processes", "2", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    end = _events(tmp_path / "out")[-1]
    ledger = end["time_ledger"]
    booked = sum(v for k, v in ledger.items() if k != "wall")
    assert abs(booked - ledger["wall"]) <= 0.02 * ledger["wall"]
    assert ledger["collective"] > 0 and ledger["evaluation"] > 0 and ledger["save"] > 0 and ledger["compute"] > 0
    # Each rank's own ledger too (rank 1's as of its last heartbeat): every second booked.
    ranks = end["time_ledger_ranks"]
    assert sorted(ranks) == ["0", "1"] and ranks["0"] == ledger
    for own in ranks.values():
        assert abs(sum(v for k, v in own.items() if k != "wall") - own["wall"]) <= 0.02 * own["wall"]
        assert own["compute"] > 0 and own["evaluation"] > 0
    logs = [e for e in _events(tmp_path / "out") if e["event"] == "log" and "loss" in e]
    assert logs and all(e["train_samples_per_second"] > 0 for e in logs)


SPIKY_PY = """\
import time
import torch
from torch import nn
from torch.utils.data import default_collate
from workbench import TrainerCallback

POISON = [False]


class Spiky(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x, labels=None):
        loss = nn.functional.cross_entropy(self.net(x), labels)
        return {"loss": loss * 1e4 if POISON[0] else loss}


def make():
    return Spiky()


def collate(rows):
    time.sleep(0.05)  # slow enough for a pause to land mid-run
    return default_collate(rows)


class SpikeOnce(TrainerCallback):
    done = False

    def on_step_begin(self, args, state, control, **kwargs):
        POISON[0] = state.global_step + 1 == 40 and not SpikeOnce.done
        SpikeOnce.done = SpikeOnce.done or POISON[0]
"""


def test_two_ranks_book_a_pause_and_a_rollback_and_still_add_up(tmp_path):
    from support.processes import start_workbench

    _project(tmp_path, max_steps=80, action="report", timeout=60)
    (tmp_path / "spiky.py").write_text(SPIKY_PY)
    toml = (tmp_path / "run.toml").read_text()
    toml = toml.replace('builtin = "mlp"\n[model.options]\nin_features = 8\nhidden = 16\nnum_classes = 3\n',
                        'factory = "spiky:make"\n')
    toml = toml.replace('data_collator = "slow:collate"\ncallbacks = ["slow:StuckBeforeCollective"]',
                        'data_collator = "spiky:collate"\ncallbacks = ["spiky:SpikeOnce"]')
    toml = toml.replace("[hooks]", 'eval_strategy = "steps"\neval_steps = 20\n[hooks]')
    toml += '[guard]\nspike = "rollback"\nwindow = 5\nsnapshot_every = 5\n'
    (tmp_path / "run.toml").write_text(toml)
    out = tmp_path / "out"
    run = start_workbench("run", "run.toml", "--headless", "--num-processes", "2", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not (out / "events.jsonl").exists() or not any(
                e["event"] == "log" and e.get("step", 0) >= 6 for e in _events(out)):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        paused = workbench("ctl", "out", "pause", "--wait", cwd=tmp_path)
        assert paused.returncode == 0, paused.stderr
        time.sleep(1.0)
        assert workbench("ctl", "out", "resume", cwd=tmp_path).returncode == 0
        assert run.wait(timeout=240) == 0, run.communicate()[1][-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    events = _events(out)
    assert any(e["event"] == "guard" for e in events), [e["event"] for e in events]
    ledger = events[-1]["time_ledger"]
    booked = sum(v for k, v in ledger.items() if k != "wall")
    assert abs(booked - ledger["wall"]) <= 0.02 * ledger["wall"]
    assert ledger["paused"] >= 0.9 and ledger["rolled_back"] > 0 and ledger["collective"] > 0
    assert ledger["evaluation"] > 0 and ledger["save"] > 0 and ledger["compute"] > 0
