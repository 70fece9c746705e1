"""Multi-process runs under the real launcher: 2 CPU processes in a gloo group.

Each launch starts two Python processes (a few seconds), so the end-to-end tests are
marked slow; CI runs them. What they pin down: 2 x B equals 1 x 2B, a 2-process
checkpoint resumes bitwise on 2 processes and closely on 1, a SIGTERM to the launcher or
to one rank gives one coordinated, verified checkpoint and exit 143, rank 0's pause,
live edit, save and evaluation take effect on both ranks at the same step, and the
dashboard on rank 0 (a real terminal, tmux) steers both ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workbench.distributed.launch import launcher_command

CONFIG = """\
run_name = "mlp-ranks"
[model]
builtin = "mlp"
[model.options]
in_features = 8
num_classes = 3
[data]
builtin = "random-classification"
[data.options]
n_train = 256
n_eval = 30
in_features = 8
num_classes = 3
[training]
output_dir = "{out}"
max_steps = {max_steps}
per_device_train_batch_size = 4
learning_rate = 1e-2
logging_steps = 1
eval_strategy = "steps"
eval_steps = 6
save_strategy = "steps"
save_steps = 6
enable_jit_checkpoint = true
seed = 3
"""


def write_config(tmp_path: Path, out: str = "out", max_steps: int = 12) -> Path:
    path = tmp_path / f"{out}.toml"
    path.write_text(CONFIG.format(out=out, max_steps=max_steps))
    return path


# -- fast checks ----------------------------------------------------------------------


def test_launcher_command_puts_cpu_ranks_in_a_gloo_group(monkeypatch, tmp_path):
    import torch
    from accelerate.commands import config as accelerate_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(accelerate_config, "default_config_file", str(tmp_path / "absent.yaml"))
    command, env = launcher_command(2, ["-m", "workbench", "run", "c.toml"], port=1234)
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert "--multi_gpu" in command and command[command.index("--num_processes") + 1] == "2"
    assert command[command.index("--main_process_port") + 1] == "1234"
    assert command[-4:] == ["-m", "workbench", "run", "c.toml"]
    assert env["ACCELERATE_USE_CPU"] == "1"


def test_launcher_command_honours_an_accelerate_config_file(tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    command, _ = launcher_command(2, ["train.py"], config_file=str(config))
    assert command[command.index("--config_file") + 1] == str(config)
    assert "--multi_gpu" not in command  # the file decides
    with pytest.raises(FileNotFoundError, match="accelerate config"):
        launcher_command(2, ["train.py"], config_file=str(tmp_path / "missing.yaml"))


def test_num_processes_must_be_positive(tmp_path, capsys):
    from workbench.cli import main

    config = write_config(tmp_path)
    assert main(["run", str(config), "--num-processes", "0"]) == 2
    assert "--num-processes: 0 is not a process count" in capsys.readouterr().err


# -- end to end under the launcher ------------------------------------------------------------


def test_fsdp_is_refused_where_accelerate_would_not_shard(tmp_path):
    from workbench import Trainer, TrainingArguments
    from workbench.core.args.training import ArgumentError
    from workbench.models import MLPClassifier

    args = TrainingArguments(str(tmp_path), fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2}, use_cpu=True)
    with pytest.raises(ArgumentError, match="Accelerate did not start FSDP here"):
        Trainer(model=MLPClassifier(in_features=4, num_classes=2), args=args)
    with pytest.raises(ArgumentError, match="fsdp: unknown option"):
        TrainingArguments(str(tmp_path), fsdp="full_shard sideways")
    with pytest.raises(ArgumentError, match="deepspeed: DeepSpeed is not installed"):
        TrainingArguments(str(tmp_path), deepspeed={"zero_optimization": {"stage": 2}})
