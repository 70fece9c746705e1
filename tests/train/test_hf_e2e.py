"""workbench side by side with transformers' Trainer, end to end: the slow pairs of runs (real
multi-process launches, long runs) whose numbers must match HF's.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the side-by-side runs need transformers (test extra)")

import json
import os
import subprocess
import sys

import tomli_w

from workbench import Trainer, TrainingArguments  # noqa: E402

from support import REPO, StopAt, assert_same_weights, weights  # noqa: E402
from test_hf_numbers import TOK, bert_config, built, classified, logged, options, side_by_side


def test_persistent_workers_draw_as_hf_and_resume_exactly(tmp_path):
    """One dataloader worker kept across epochs and evaluations: torch then draws a base seed
    only when each loader's first iterator starts (the train loader's first epoch, each eval
    set's first evaluation). Losses equal HF's bitwise, and a run resumed after the first
    evaluation (step 5 of 9, mid-epoch) does not draw again: bitwise the uninterrupted run."""
    args = dict(num_train_epochs=3, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                dataloader_num_workers=1, dataloader_persistent_workers=True, eval_strategy="steps", eval_steps=2)
    data = dict(train_dataset=classified(24, 0), eval_dataset=classified(10, 1),
                data_collator=transformers.DataCollatorWithPadding(TOK))
    make = lambda: built(transformers.BertForSequenceClassification, bert_config(num_labels=2))  # noqa: E731
    made = side_by_side(make, args, tmp_path, **data)
    assert len(logged(made["wb"])) == 9 and logged(made["wb"]) == logged(made["hf"])
    assert logged(made["wb"], "eval_loss") == logged(made["hf"], "eval_loss")
    out = tmp_path / "resumed"
    saving = dict(args, save_strategy="steps", save_steps=100)
    Trainer(model=make(), args=TrainingArguments(**options(out, **saving)), callbacks=[StopAt(5)], **data).train()
    second = Trainer(model=make(), args=TrainingArguments(**options(out, **saving)), **data)
    second.train(resume_from_checkpoint=True)
    assert logged(second) == logged(made["wb"])
    assert logged(second, "eval_loss") == logged(made["wb"], "eval_loss")
    assert_same_weights(weights(second), weights(made["hf"]))


def test_cli_resume_accepts_the_names_workbench_checkpoints_prints(tmp_path):
    out = tmp_path / "runs"
    config = tmp_path / "cfg.toml"
    config.write_text(tomli_w.dumps({
        "model": {"builtin": "mlp", "options": {"in_features": 8, "num_classes": 3}},
        "data": {"builtin": "random-classification", "options": {"n_train": 32, "n_eval": 8, "in_features": 8,
                                                                 "num_classes": 3}},
        "training": {"output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1,
                     "save_strategy": "steps", "save_steps": 2, "seed": 3},
    }))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "workbench.cli", *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    first = cli("run", str(config), "--headless")
    assert first.returncode == 0, first.stderr
    listed = cli("checkpoints", str(out), "--json")
    names = [row["name"] for row in json.loads(listed.stdout)]
    assert names == ["checkpoint-2", "checkpoint-4"]
    resumed = cli("run", str(config), "--headless", "--resume", names[0], "--set", "training.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr
    assert "step 3/6" in resumed.stdout and "step 1/6" not in resumed.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    unknown = cli("run", str(config), "--headless", "--resume", "checkpoint-99")
    assert unknown.returncode == 2
    [line] = unknown.stderr.strip().splitlines()
    assert "checkpoint-99" in line and "checkpoint-2, checkpoint-4, checkpoint-6" in line
