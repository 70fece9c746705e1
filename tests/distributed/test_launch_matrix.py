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
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, subprocess_env

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


def write_project(tmp_path: Path, out: str = "out", max_steps: int = 10, batch: int = 4) -> Path:
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


def run_launch(command: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=subprocess_env(**env), cwd=cwd, timeout=timeout)


def workbench_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "workbench", *args]


def history_of(checkpoint: Path) -> list[dict]:
    return json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]


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

    config = write_project(tmp_path)
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
    from workbench.checkpoint.lock import OutputDirBusy, OutputDirLock
    from workbench.cli import main

    config = write_project(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
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
    config = write_project(tmp_path)
    result = run_launch(workbench_command("run", str(config), "--headless"), tmp_path, timeout=120, **env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("workbench:")]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "checkpoint-5").exists()


# -- the launch matrix ---------------------------------------------------------------------------


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
