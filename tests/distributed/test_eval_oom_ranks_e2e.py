"""Out of memory in evaluation on one rank of two (``workbench run --num-processes 2``, DDP on
2 CPU ranks; train/eval_oom.py). The injected error strikes rank 1 alone, in the first
evaluation forward after training: the one in which DDP broadcasts the model's buffer, so a
redo that broadcast again on that rank alone would unpair the ranks' collectives. That rank
redoes its batch in halves joined before the gathers; the evaluation's loss and metrics equal
an uncut run's (the rows, their order and the accuracy exactly: no row gathered twice or
dropped), the training is untouched (weights bitwise equal, no edit), the run goes on, and
from the next evaluation both ranks cut their batches alike. No ``WORKBENCH_OOM_AGREEMENT``
is needed: the agreement costs one store look-up an evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.processes import workbench

from workbench.core.event_file import read_events

pytestmark = pytest.mark.slow

CONFIG = """\
[model]
factory = "tight:make"
[data]
builtin = "random-classification"
[data.options]
n_train = 512
n_eval = 40
in_features = 8
num_classes = 3
[training]
output_dir = "out"
max_steps = 8
per_device_train_batch_size = 16
per_device_eval_batch_size = 16
learning_rate = 0.05
lr_scheduler_type = "constant"
eval_strategy = "steps"
eval_steps = 4
save_steps = 8
logging_steps = 1
report_to = "jsonl"
disable_tqdm = true
seed = 0
[hooks]
callbacks = ["tight:Steps"]
compute_metrics = "tight:metrics"
"""

TIGHT_PY = """\
import json
import os

import numpy as np
import torch
from torch import nn
from workbench import TrainerCallback

RANK = int(os.environ.get("RANK", "0"))
WHO = os.environ.get("WB_EVAL_OOM_RANK")  # the rank whose first evaluation forward runs out
STEP = [0]
ROWS = []  # (step, rows) of every evaluation forward of this rank


class Tight(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        self.register_buffer("scale", torch.ones(1))  # DDP broadcasts it in the first forward after training
        self.failed = 0

    def forward(self, x, labels=None):
        if not self.training:
            ROWS.append((STEP[0], x.shape[0]))
            if WHO is not None and RANK == int(WHO) and x.shape[0] > 8 and not self.failed:
                self.failed += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected, evaluation)")
        logits = self.net(x) * self.scale
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def make():
    return Tight()


def metrics(pred):
    # The rows and their order too: a row gathered twice, dropped or moved changes them.
    labels = np.asarray(pred.label_ids)
    return {"accuracy": float((np.argmax(pred.predictions, -1) == labels).mean()), "rows": float(labels.size),
            "order": float((labels * np.arange(1, labels.size + 1)).sum())}


class Steps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        STEP[0] = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        with open(f"rows-{RANK}.json", "w") as f:
            json.dump(ROWS, f)
"""


def _run(where: Path, env: dict[str, str] | None = None) -> Path:
    where.mkdir(parents=True)
    (where / "tight.py").write_text(TIGHT_PY)
    (where / "run.toml").write_text(CONFIG)
    done = workbench("run", "run.toml", "--headless", "--num-processes", "2", cwd=where, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return where


def _evals(where: Path) -> dict[int, dict]:
    return {e["step"]: e for e in read_events(where / "out") if e["event"] == "eval"}


def _rows(where: Path, rank: int, step: int) -> list[int]:
    return [rows for at, rows in json.loads((where / f"rows-{rank}.json").read_text()) if at == step]


def test_an_eval_oom_on_one_rank_is_recovered_with_the_same_metrics_and_training(tmp_path):
    plain = _run(tmp_path / "plain")
    tight = _run(tmp_path / "tight", env={"WB_EVAL_OOM_RANK": "1"})
    # The evaluations at steps 4 and 8 say what the uncut ones say.
    want, got = _evals(plain), _evals(tight)
    assert sorted(got) == sorted(want) == [4, 8]
    for step in (4, 8):
        assert got[step]["eval_loss"] == pytest.approx(want[step]["eval_loss"], rel=1e-6)
        for key in ("eval_accuracy", "eval_rows", "eval_order"):
            assert got[step][key] == want[step][key], (step, key)
        assert got[step]["eval_rows"] == 40
    # Rank 1's first forward ran out and its batch was redone in halves; rank 0 redid nothing.
    assert _rows(tight, 1, 4)[:3] == [16, 8, 8] and max(_rows(tight, 1, 4)[1:]) <= 8
    assert _rows(tight, 0, 4) == _rows(plain, 0, 4) and max(_rows(plain, 0, 4)) == 16
    # From the next evaluation on, both ranks cut alike.
    assert max(_rows(tight, 0, 8)) <= 8 and max(_rows(tight, 1, 8)) <= 8
    # Recorded once, naming the rank; no edit: the training batch and weights are untouched.
    events = read_events(tight / "out")
    records = [e for e in events if e["event"] == "eval_oom"]
    assert len(records) == 1 and records[0]["step"] == 4 and records[0]["split"] == 2
    assert [cut["rank"] for cut in records[0]["cuts"]] == [1]
    assert "out of memory in evaluation on rank 1: eval batch 16 -> 8 rows" in records[0]["reason"]
    assert not [e for e in events if e["event"] == "edit"]
    state = json.loads((tight / "out" / "checkpoint-8" / "workbench_state.json").read_text())
    assert not state["live_edits"]
    got_weights = load_file(str(tight / "out" / "checkpoint-8" / "model.safetensors"))
    want_weights = load_file(str(plain / "out" / "checkpoint-8" / "model.safetensors"))
    assert got_weights.keys() == want_weights.keys()
    for name in want_weights:
        assert torch.equal(got_weights[name], want_weights[name]), name
    assert [e for e in events if e["event"] == "end"][-1]["status"] == "finished"
