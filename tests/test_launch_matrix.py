"""Multi-process runs with user data are what they seem (issue 14).

A factory model from the config's folder, local jsonl files tokenized through ``[data]``,
an eval set and a save every N steps: the path a user takes, where a distributed state
made early by data loading once left every rank training alone into one folder. Each
launch form must give one events.jsonl from rank 0, a final checkpoint that verifies with
one RNG file per rank, and the losses of one process with the same global batch. Also:
one writer per output_dir, the world-size guard, ``--resume`` checks before any work, and
a rank killed mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Spawned

from workbench.checkpoint.store import CheckpointStore

REPO = Path(__file__).resolve().parents[1]

MODEL = """\
import torch
from torch import nn


class TinyLM(nn.Module):
    loss_type = "ForCausalLM"

    def __init__(self, vocab: int = 256, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.head(self.emb(input_ids))}


def build(vocab: int = 256, dim: int = 16):
    return TinyLM(vocab, dim)
"""

CONFIG = """\
run_name = "user-data"
[model]
factory = "user_model:build"
[data]
train = {{ path = "json", data_files = "train.jsonl", split = "train" }}
eval = {{ path = "json", data_files = "eval.jsonl", split = "train" }}
text_column = "text"
tokenizer = "char"
max_length = 24
[training]
output_dir = "{out}"
max_steps = {max_steps}
per_device_train_batch_size = {batch}
per_device_eval_batch_size = 8
learning_rate = 1e-2
logging_steps = 1
eval_strategy = "steps"
eval_steps = 5
save_strategy = "steps"
save_steps = 5
seed = 7
"""

WORDS = "the quick brown fox jumps over a lazy dog and runs far into the green forest".split()


def _project(tmp_path: Path, out: str = "out", max_steps: int = 10, batch: int = 4) -> Path:
    """A user's project folder: model module, jsonl data, config. Returns the config path."""
    import random

    if not (tmp_path / "user_model.py").exists():
        (tmp_path / "user_model.py").write_text(MODEL)
        rng = random.Random(0)
        for name, rows in (("train.jsonl", 160), ("eval.jsonl", 21)):
            with open(tmp_path / name, "w") as f:
                for _ in range(rows):
                    f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(8))}) + "\n")
    config = tmp_path / f"{out}.toml"
    config.write_text(CONFIG.format(out=out, max_steps=max_steps, batch=batch))
    return config


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=_env(**env), cwd=cwd, timeout=timeout)


def _workbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "workbench", *args]


def _history(checkpoint: Path) -> list[dict]:
    return json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]


def _losses(checkpoint: Path) -> tuple[list[float], list[float]]:
    history = _history(checkpoint)
    return [h["loss"] for h in history if "loss" in h], [h["eval_loss"] for h in history if "eval_loss" in h]


# -- fast checks -------------------------------------------------------------------------------


def test_cpu_ranks_are_chosen_where_there_is_no_accelerator(monkeypatch):
    from workbench.core import world

    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_ID", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    assert world.launched_world_size() is None and not world.wants_cpu()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(world, "_has_accelerator", lambda: False)
    assert world.launched_world_size() == (2, "WORLD_SIZE") and world.wants_cpu()
    monkeypatch.setattr(world, "_has_accelerator", lambda: True)
    assert not world.wants_cpu()  # GPU ranks: Accelerate picks NCCL itself
    monkeypatch.delenv("WORLD_SIZE")
    # srun's task count counts only inside an srun step.
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert world.launched_world_size() is None
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert world.launched_world_size() == (4, "SLURM_STEP_NUM_TASKS")


def test_resume_path_that_is_not_a_checkpoint_is_refused_before_any_work(tmp_path, capsys):
    from workbench.cli import main

    config = _project(tmp_path)
    out = tmp_path / "out"
    cases = {
        "does not exist": str(tmp_path / "nope"),
        "is a file, not a checkpoint folder": str(tmp_path / "train.jsonl"),
        "is not a checkpoint (it has no trainer_state.json)": str(tmp_path),
    }
    for expected, path in cases.items():
        assert main(["run", str(config), "--headless", "--resume", path]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()  # nothing created
    # An output_dir where a checkpoint was asked for: the newest checkpoint is named.
    (tmp_path / "runs" / "checkpoint-4").mkdir(parents=True)
    (tmp_path / "runs" / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert main(["run", str(config), "--headless", "--resume", str(tmp_path / "runs")]) == 2
    assert "is an output_dir, not a checkpoint" in capsys.readouterr().err
    # No manifest, and not a transformers checkpoint either (no weights): named as such.
    assert main(["run", str(config), "--headless", "--resume", str(tmp_path / "runs" / "checkpoint-4")]) == 2
    assert "no manifest.json, and not laid out as a transformers checkpoint" in capsys.readouterr().err
    assert not out.exists()


HOLDER = """\
import sys, time
from workbench.checkpoint.lock import OutputDirLock
lock = OutputDirLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_one_writer_per_output_dir_and_a_killed_holder_is_taken_over(tmp_path, capsys, caplog):
    from workbench.cli import main
    from workbench.checkpoint.lock import OutputDirBusy, OutputDirLock

    config = _project(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              env=_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        # A second run into the same folder is refused, naming the holder; nothing is written.
        assert main(["run", str(config), "--headless"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"is in use by another run (pid {holder.pid} on {socket.gethostname()}" in err
        assert len(err.splitlines()) == 1
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
        with pytest.raises(OutputDirBusy):
            OutputDirLock(out).acquire()
    finally:
        holder.kill()  # SIGKILL: the holder never releases its lock
        holder.wait()
    assert json.loads((out / ".lock").read_text())["pid"] == holder.pid  # left behind
    lock = OutputDirLock(out)
    with caplog.at_level("WARNING", logger="workbench"):
        message = lock.acquire()
    assert message and f"took over a stale lock (pid {holder.pid}" in message
    assert "took over a stale lock" in caplog.text
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / ".lock").exists()


def test_a_trainer_in_the_same_process_cannot_train_into_a_held_folder(tmp_path):
    import torch

    from workbench import Trainer, TrainingArguments
    from workbench.checkpoint.lock import OutputDirBusy, OutputDirLock

    out = tmp_path / "held"
    out.mkdir()
    lock = OutputDirLock(out)
    lock.acquire()
    data = [{"x": torch.randn(4), "labels": torch.tensor(1)} for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    model.loss_type = "ForSequenceClassification"
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_strategy="no", report_to="none",
                             disable_tqdm=True)

    class Wrap(torch.nn.Module):
        loss_type = "ForSequenceClassification"

        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return {"logits": self.inner(x)}

    trainer = Trainer(model=Wrap(), args=args, train_dataset=data)
    with pytest.raises(OutputDirBusy, match="is in use by another run"):
        trainer.train()
    lock.release()
    trainer.train()  # free again
    assert not (out / ".lock").exists()


GUARD_CASES = {
    # srun started two tasks that never formed a group: each would train alone.
    "srun": ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"},
             "the launcher started 2 processes (SLURM_STEP_NUM_TASKS=2) but Accelerate sees 1"),
    # A launcher's WORLD_SIZE without the rendezvous that goes with it.
    "no-rendezvous": ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
                      "WORLD_SIZE=2 says this is one of 2 processes, but the process group could not start"),
}


@pytest.mark.parametrize("case", sorted(GUARD_CASES))
def test_a_launch_that_would_train_alone_refuses_to_start(tmp_path, case):
    env, expected = GUARD_CASES[case]
    config = _project(tmp_path)
    result = _run(_workbench("run", str(config), "--headless"), tmp_path, timeout=120, **env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("workbench:")]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "checkpoint-5").exists()


# -- the launch matrix ---------------------------------------------------------------------------


def _launch_forms(config: Path) -> dict[str, list[list[str]]]:
    """Each form: the commands to start together (two for the two-"node" launch)."""
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    port = str(_free_port())
    nodes = [[*accelerate, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(rank),
              "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--num_processes", "2",
              "--mixed_precision", "no", "--dynamo_backend", "no",
              "-m", "workbench", "run", str(config), "--headless"] for rank in (0, 1)]
    return {
        "workbench --num-processes": [_workbench("run", str(config), "--headless", "--num-processes", "2")],
        "accelerate launch --multi_gpu": [[*accelerate, "--multi_gpu", "--num_processes", "2",
                                           "--main_process_port", port, "--mixed_precision", "no",
                                           "--dynamo_backend", "no", "-m", "workbench", "run", str(config),
                                           "--headless"]],
        "torchrun": [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                      "--master-port", port, "-m", "workbench", "run", str(config), "--headless"]],
        "two nodes": nodes,
    }


def _start_all(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cwd)
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


@pytest.mark.slow
def test_every_launch_form_trains_one_run_with_user_data(tmp_path):
    single = _run(_workbench("run", str(_project(tmp_path, "single", batch=8)), "--headless"), tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    train1, eval1 = _losses(tmp_path / "single" / "checkpoint-10")
    assert len(train1) == 10 and len(eval1) == 2

    for i, (form, commands) in enumerate(_launch_forms(_project(tmp_path, "two", batch=4)).items()):
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


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_launch_and_the_newest_checkpoint_resumes(tmp_path):
    config = _project(tmp_path, "long", max_steps=100000)
    out = tmp_path / "long"
    launcher = Spawned(_workbench("run", str(config), "--headless", "--num-processes", "2"), env=_env(),
                       cwd=tmp_path, logs=tmp_path / "logs")
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoint-15").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "checkpoint-15").is_dir(), "the run did not reach step 15"
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
    resumed = _run(_workbench("run", str(config), "--headless", "--num-processes", "2", "--resume",
                              "--set", f"training.max_steps={target}"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = out / f"checkpoint-{target}"
    assert CheckpointStore(out).verify(final) == (True, None)
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(final))
    steps = [h["step"] for h in _history(final) if "loss" in h]
    assert steps[-5:] == list(range(newest.step + 1, target + 1))


def test_readme_lists_the_launch_forms():
    readme = (REPO / "README.md").read_text()
    for form in ("workbench run CONFIG --num-processes", "accelerate launch --multi_gpu", "torchrun --nproc-per-node",
                 "--num_machines 2 --machine_rank"):
        assert form in readme, form



def test_trainers_in_one_process_share_the_lock_and_the_last_releases_it(tmp_path):
    from workbench.checkpoint.lock import OutputDirBusy, OutputDirLock, hold_output_dir

    out = tmp_path / "shared"
    with hold_output_dir(out):
        with hold_output_dir(out):  # a notebook cell run again while its Session trains
            pass
        assert (out / ".lock").exists()  # the first holder still has it
        with pytest.raises(OutputDirBusy):  # another process (an independent lock) is kept out
            OutputDirLock(out).acquire()
    assert not (out / ".lock").exists()
