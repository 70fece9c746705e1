"""Several processes end to end: real ``accelerate launch`` / ``workbench run --num-processes 2`` on
CPU processes (gloo), with the same numbers as one process, signals that reach every rank and
the ranks held together while one of them waits.
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
from workbench.distributed.launch import launcher_command

from support import REPO, Spawned, poll_until, subprocess_env
from test_multiprocess import write_config


def _run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a launch; one retry when the rendezvous port was taken in between (shared machine)."""
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=cwd, timeout=timeout)
    if result.returncode not in (0, 143) and "address already in use" in result.stderr.lower():
        result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=cwd, timeout=timeout)
    return result


def _workbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "workbench", *args]


def _losses(checkpoint: Path) -> tuple[list[float], list[float]]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return ([h["loss"] for h in history if "loss" in h], [h["eval_loss"] for h in history if "eval_loss" in h])


def _wait_for_step(events: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if events.is_file():
            for line in events.read_text().splitlines():
                record = json.loads(line)
                if record.get("event") == "log" and record.get("step", 0) >= step:
                    return
        time.sleep(0.2)
    raise AssertionError(f"no log at step {step} within {timeout} s")


def _rank_pids(config: Path, rank: int) -> list[int]:
    """The processes running ``config`` whose environment says RANK=<rank>."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and str(config).encode() in cmdline and b"accelerate" not in cmdline:
            found.append(int(proc.name))
    return found


_SESSION_SCRIPT = r'''
import json, sys, time
from pathlib import Path
from workbench import TrainerCallback
from workbench.config.build import build_trainer
from workbench.config.loader import load_config
from workbench.session.local import Session

out = Path(sys.argv[1])
run = load_config(sys.argv[2], ["training.max_steps=300", "training.eval_strategy=no", "training.save_strategy=no"])
trainer = build_trainer(run)
rank = trainer.accelerator.process_index
seen = {"end": [], "lr": []}

class Record(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        seen["end"].append([state.global_step, time.monotonic()])
        seen["lr"].append([state.global_step, trainer.optimizer.param_groups[0]["lr"]])

trainer.add_callback(Record())
session = Session(trainer)
session.start()
report = {}
if rank == 0:
    while session.snapshot().step < 8:
        time.sleep(0.01)
    report["pause_status"] = session.pause(wait=True, timeout=60)
    report["paused_at"] = session.snapshot().step
    time.sleep(1.5)  # several heartbeats: rank 1 must still be waiting afterwards
    report["edit"] = session.set(learning_rate=0.05)
    report["saved"] = str(session.save())
    report["eval_loss"] = session.evaluate()["eval_loss"]
    try:
        session.set(not_a_field=1)
    except ValueError as exc:
        report["refused"] = str(exc)
    session.resume()
    # While running: the edit and the save wait for the next agreement, then happen on both ranks.
    report["running_edit"] = session.set(learning_rate=0.02).result(timeout=120)
    report["running_saved"] = str(session.save().result(timeout=120))
else:
    try:
        session.pause()
    except RuntimeError as exc:
        report["refused"] = str(exc)
report["status"] = session.wait()
report["live_edits"] = trainer.workbench_state.live_edits
report.update(seen)
(out / f"rank{rank}.json").write_text(json.dumps(report))
trainer.accelerator.wait_for_everyone()
import torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()
'''

_FORCED_FSDP = r'''
import os, sys
from pathlib import Path
import workbench.train.loop as loop
import workbench.train.trainer as trainer_module
from workbench.distributed.sharding import _fsdp_plugin

make_accelerator = trainer_module.make_accelerator

def forced_fsdp(args):
    # Accelerate 1.15 shards only on accelerators and silently uses DDP on CPU ranks; put
    # its FSDP2 path in place here so the sharded save/load code runs for real (gloo).
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    acc = make_accelerator(args)
    PartialState._shared_state["distributed_type"] = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = _fsdp_plugin(args)
    return acc

prepare_for_training = loop.prepare_for_training

def recording_prepare(run):
    model = prepare_for_training(run)
    Path(os.environ["PARAM_KIND"]).write_text(type(next(model.parameters())).__name__)
    return model

trainer_module.make_accelerator = forced_fsdp
loop.prepare_for_training = recording_prepare
from workbench.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_two_processes_match_one_process_and_checkpoints_resume(tmp_path):
    # 2 x B through a plain `accelerate launch -m workbench run` ...
    config = write_config(tmp_path, "two")
    command, env = launcher_command(2, ["-m", "workbench", "run", str(config), "--headless"])
    two = subprocess.run(command, capture_output=True, text=True, env={**env, **subprocess_env()}, cwd=tmp_path, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    # ... equals 1 x 2B.
    one = _run(_workbench("run", str(write_config(tmp_path, "one")), "--headless",
                          "--set", "training.per_device_train_batch_size=8"), tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    train2, eval2 = _losses(tmp_path / "two" / "checkpoint-12")
    train1, eval1 = _losses(tmp_path / "one" / "checkpoint-12")
    assert len(train2) == 12 and train2 == pytest.approx(train1, rel=1e-5, abs=1e-6)
    # Evaluation gathers both ranks without the repeats that top up the last batch (30 = 16 + 14).
    assert len(eval2) == 2 and eval2 == pytest.approx(eval1, rel=1e-5, abs=1e-6)
    # total_flos is summed over the ranks (store_flos): 2 x B tokens count as 1 x 2B.
    flos2, flos1 = (json.loads((tmp_path / run / "checkpoint-12" / "trainer_state.json").read_text())["total_flos"]
                    for run in ("two", "one"))
    assert flos2 == flos1 > 0

    checkpoint = tmp_path / "two" / "checkpoint-6"
    store = CheckpointStore(tmp_path / "two")
    assert store.verify(checkpoint) == (True, None)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"])

    # Resume on 2 processes: bitwise the same losses as the uninterrupted run.
    resumed2 = _run(_workbench("run", str(config), "--headless", "--num-processes", "2",
                               "--resume", str(checkpoint), "--set", "training.output_dir=two-resumed"), tmp_path)
    assert resumed2.returncode == 0, resumed2.stderr[-3000:]
    assert _losses(tmp_path / "two-resumed" / "checkpoint-12")[0][-6:] == train2[-6:]
    # Resume on 1 process with the doubled batch: the same run, up to float rounding.
    resumed1 = _run(_workbench("run", str(config), "--headless", "--resume", str(checkpoint),
                               "--set", "training.output_dir=one-resumed",
                               "--set", "training.per_device_train_batch_size=8"), tmp_path)
    assert resumed1.returncode == 0, resumed1.stderr[-3000:]
    assert _losses(tmp_path / "one-resumed" / "checkpoint-12")[0][-6:] == pytest.approx(train2[-6:], rel=1e-5)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_sigterm_to_launcher_or_one_rank_saves_one_checkpoint_and_resumes(tmp_path):
    config = write_config(tmp_path, "out", max_steps=100_000)
    overrides = ["--set", "training.logging_steps=20", "--set", "training.eval_strategy=no",
                 "--set", "training.save_steps=100000"]
    out = tmp_path / "out"
    store = CheckpointStore(out)
    stopped_at = []
    for target in ("launcher", "rank 1"):
        args = ["run", str(config), "--headless", "--num-processes", "2", *overrides]
        if target != "launcher":
            args.append("--resume")
        proc = Spawned(_workbench(*args), env=subprocess_env(), cwd=tmp_path, logs=tmp_path / "logs")
        try:
            _wait_for_step(out / "events.jsonl", (stopped_at[-1] if stopped_at else 0) + 40, proc)
            if target == "launcher":
                proc.send_signal(signal.SIGTERM)
            else:
                pids = _rank_pids(config, 1)
                assert pids, "rank 1 not found"
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 143, (target, err[-3000:])
        assert "stopped by SIGTERM" in err
        infos = [c for c in store.list() if c.complete]
        assert len(infos) == len(stopped_at) + 1  # one new checkpoint per stop
        newest = infos[-1]
        assert store.verify(newest.path) == (True, None)
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in Path(newest.path).iterdir()}
        stopped_at.append(newest.step)
    assert stopped_at[1] > stopped_at[0]  # the second run resumed and went on
    # Finish from the last stop: a short remaining run.
    final = _run(_workbench("run", str(config), "--headless", "--num-processes", "2", "--resume",
                            *overrides[:2], "--set", f"training.max_steps={stopped_at[-1] + 10}"), tmp_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert store.latest_verified().step == stopped_at[-1] + 10


def test_pause_edit_save_and_evaluate_from_rank0_apply_on_both_ranks(tmp_path):
    script = tmp_path / "session_ranks.py"
    script.write_text(_SESSION_SCRIPT)
    config = write_config(tmp_path, "out")
    command, env = launcher_command(2, [str(script), str(tmp_path), str(config)])
    result = subprocess.run(command, capture_output=True, text=True, env={**env, **subprocess_env()}, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    zero, one = ranks
    assert zero["pause_status"] == "paused" and zero["status"] == one["status"] == "finished"
    assert "with several processes the run is steered from rank 0" in one["refused"]
    paused_at = zero["paused_at"]
    for rank in ranks:
        # The pause: the one long gap between step ends, before the same step on both ranks.
        ends = rank["end"]
        gaps = [(b[1] - a[1], b[0]) for a, b in zip(ends, ends[1:])]
        longest, step = max(gaps)
        assert longest > 1.0 and step == paused_at + 1
        assert sorted(gaps)[-2][0] < 1.0
        # The edit: the same learning rate on both ranks at every step, new from the pause on.
        lr = {int(k): v for k, v in rank["lr"]}
        assert lr[paused_at + 1] > 3 * lr[paused_at]  # base 0.01 -> 0.05 on the linear decay
        edits = rank["live_edits"]
        assert [e["learning_rate"] for e in edits] == [0.05, 0.02]
        assert edits[0]["step"] == paused_at and edits[1]["step"] > paused_at
    assert dict(zero["lr"]) == dict(one["lr"])  # every edit took effect at the same step on both ranks
    assert zero["live_edits"] == one["live_edits"]
    assert zero["running_edit"] == {"learning_rate": 0.02}
    running_saved = Path(zero["running_saved"])
    assert CheckpointStore(running_saved.parent).verify(running_saved) == (True, None)
    assert (running_saved / "rng_state_1.pth").is_file()
    saved = Path(zero["saved"])
    assert saved.name == f"checkpoint-{paused_at}"
    assert CheckpointStore(saved.parent).verify(saved) == (True, None)
    assert (saved / "rng_state_1.pth").is_file()
    assert zero["eval_loss"] > 0


def test_fsdp2_checkpoint_resumes_bitwise_on_fsdp_and_closely_on_one_process(tmp_path):
    script = tmp_path / "fsdp_ranks.py"
    script.write_text(_FORCED_FSDP)
    config = write_config(tmp_path, "fsdp")
    with config.open("a") as f:
        f.write('fsdp = "full_shard"\nfsdp_config = { fsdp_version = 2 }\n')

    def launch(*args: str) -> subprocess.CompletedProcess:
        command, env = launcher_command(2, [str(script), "run", str(config), "--headless", *args])
        env = {**env, **subprocess_env(), "PARAM_KIND": str(tmp_path / "param-kind.txt")}
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

    full = launch()
    assert full.returncode == 0, full.stderr[-3000:]
    assert (tmp_path / "param-kind.txt").read_text() == "DTensor"  # really sharded
    train_full, _ = _losses(tmp_path / "fsdp" / "checkpoint-12")
    checkpoint = tmp_path / "fsdp" / "checkpoint-6"
    optimizer = __import__("torch").load(checkpoint / "optimizer.pt", weights_only=True)
    assert all(isinstance(name, str) for name in optimizer["state"])  # gathered, keyed by parameter name

    resumed = launch("--resume", str(checkpoint), "--set", "training.output_dir=fsdp-resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(tmp_path / "fsdp-resumed" / "checkpoint-12")[0][-6:] == train_full[-6:]
    one = _run(_workbench("run", str(write_config(tmp_path, "one")), "--headless", "--resume", str(checkpoint),
                          "--set", "training.per_device_train_batch_size=8"), tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "saved by 2 process(es) and resumes on 1" in one.stderr
    assert _losses(tmp_path / "one" / "checkpoint-12")[0][-6:] == pytest.approx(train_full[-6:], rel=1e-5)


@pytest.mark.skipif(__import__("shutil").which("tmux") is None, reason="needs tmux (.ci/run installs it)")
def test_dashboard_on_rank_0_steers_both_ranks_in_a_real_terminal(tmp_path):
    config = write_config(tmp_path, "out", max_steps=100_000)
    out = tmp_path / "out"
    status = tmp_path / "exit-code"
    name = f"wb-ranks-{tmp_path.name}"[:40]
    command = (f"cd {tmp_path} && OMP_NUM_THREADS=1 PYTHONPATH={REPO} {sys.executable} -m workbench run {config} "
               "--num-processes 2 --set training.logging_steps=20 --set training.eval_strategy=no "
               f"--set training.save_steps=100000; echo $? > {status}")
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "110", "-y", "32", command], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout

    def wait_screen(condition, what: str, timeout: float = 180.0):
        deadline = time.monotonic() + timeout
        while True:
            text = screen()
            result = condition(text)
            if result:
                return result
            if time.monotonic() > deadline or status.exists():
                raise AssertionError(f"timed out waiting for {what}; the screen:\n{text}")
            time.sleep(0.3)

    import re

    def step_of(text: str) -> int | None:
        match = re.search(r"step (\d+)/100000", text)
        return int(match.group(1)) if match else None

    try:
        wait_screen(lambda s: "RUNNING" in s and (step_of(s) or 0) >= 100, "training past step 100")
        subprocess.run(["tmux", "send-keys", "-t", name, "space"], check=True)
        paused = wait_screen(lambda s: "PAUSED" in s and s, "the PAUSED badge")
        step = step_of(paused)
        time.sleep(1.5)  # heartbeats keep rank 1 waiting with rank 0
        assert step_of(screen()) == step, "the run moved while paused"
        subprocess.run(["tmux", "send-keys", "-t", name, "s"], check=True)  # a save while paused: both ranks
        store = CheckpointStore(out)
        wait_screen(lambda s: any(c.complete and c.step == step for c in store.list()), "the paused save")
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (out / f"checkpoint-{step}").iterdir()}
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        wait_screen(lambda s: "Stop and save" in s, "the quit dialog")
        subprocess.run(["tmux", "send-keys", "-t", name, "Enter"], check=True)
        poll_until(status.exists, 120, every=0.3)
        assert status.read_text().strip() == "0"
        assert [c.step for c in store.list() if c.complete] == [step]  # stopped while paused: same step
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events].count("start") == 1  # only rank 0 writes the log
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
