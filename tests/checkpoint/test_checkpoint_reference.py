"""The reference's checkpoint examples (save_strategy best with perplexity, resume True and a
path, enable_jit_checkpoint, SIGTERM in process), the catalog (API and CLI, no hashing) and
sharded weights with an index.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import workbench.checkpoint.store as ckpt
import workbench.checkpoint.trainer_state as ckpt_state
from workbench import Trainer, TrainerCallback, TrainingArguments
from workbench.checkpoint.store import CheckpointStore
from workbench.checkpoint.trainer_state import save_model_files
from workbench.cli import main as cli_main

from support.checkpointing import EVAL, TRAIN, assert_same_run, checkpoint_names, gpt, logged, make_args, run
from support.damage import flip_byte

# ------------------------------------------------------------------ 9. the reference


def _perplexity(pred) -> dict[str, float]:
    logits, labels = pred.predictions, pred.label_ids
    logits = torch.as_tensor(np.asarray(logits))[:, :-1].float()
    labels = torch.as_tensor(np.asarray(labels))[:, 1:].long()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return {"perplexity": math.exp(loss.item())}


def test_reference_save_strategy_best_with_perplexity(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, train_dataset, eval_dataset, compute_metrics = gpt(0), TRAIN, EVAL, _perplexity
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir="out",
            eval_strategy="epoch",
            save_strategy="best",
            metric_for_best_model="perplexity",   # save when eval perplexity improves
            greater_is_better=False,              # lower perplexity is better
            load_best_model_at_end=True,          # load the best weights after training finishes
            num_train_epochs=3, learning_rate=1e-2, report_to="none", disable_tqdm=True,  # (small run)
        ),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,          # must return {"perplexity": ...}
    )
    trainer.train()
    evals = logged(trainer, "eval_perplexity")
    assert [s for s, _ in evals] == [6, 12, 18]
    improved, best = [], math.inf
    for step, value in evals:
        if value < best:
            improved.append(f"checkpoint-{step}")
            best = value
    assert checkpoint_names("out") == improved
    assert trainer.state.best_metric == best
    assert Path(trainer.state.best_model_checkpoint).name == improved[-1]
    saved = load_file(f"out/{improved[-1]}/model.safetensors")
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved.items())


def test_reference_resume_true_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    full = run("full", max_steps=6)
    run("out", max_steps=6, save_strategy="steps", save_steps=3)
    trainer = Trainer(model=gpt(3), args=make_args("out", max_steps=6, save_strategy="steps", save_steps=3),
                      train_dataset=TRAIN)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6 and logged(trainer) == logged(full)
    trainer.train(resume_from_checkpoint="out/checkpoint-3")
    assert_same_run(full, trainer)


def test_reference_enable_jit_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    training_args = TrainingArguments(
        output_dir="your-model",
        enable_jit_checkpoint=True,
        max_steps=3, per_device_train_batch_size=4, report_to="none", disable_tqdm=True,  # (small run)
    )
    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(model=gpt(0), args=training_args, train_dataset=TRAIN)
    assert trainer.train().global_step == 3
    assert signal.getsignal(signal.SIGTERM) == before


def test_jit_checkpoint_on_sigterm_in_process(tmp_path):
    full = run(tmp_path / "full", max_steps=10)

    class SendSigterm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "jit"
    before = signal.getsignal(signal.SIGTERM)
    cut = run(out, max_steps=10, enable_jit_checkpoint=True, callbacks=[SendSigterm()])
    assert signal.getsignal(signal.SIGTERM) == before
    assert cut.stop_request.reason == "SIGTERM"
    step = cut.state.global_step
    assert step in (4, 5) and step < 10
    store = CheckpointStore(out)
    assert checkpoint_names(out) == [f"checkpoint-{step}"]
    assert store.verify(out / f"checkpoint-{step}") == (True, None)
    assert not (out / f"checkpoint-{step}" / ckpt.SENTINEL).exists()
    resumed = run(out, max_steps=10, enable_jit_checkpoint=True, resume=True)
    assert_same_run(full, resumed)


# ------------------------------------------------------------------ 10. catalog


def test_catalog_rows_cli_and_no_hashing(tmp_path, monkeypatch, capsys):
    t0 = time.time()
    trainer = run(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps",
                  eval_steps=2, eval_dataset=EVAL, metric_for_best_model="loss", greater_is_better=False)
    t1 = time.time()

    def no_hashing(*a, **k):
        raise AssertionError("list() must not hash")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "_sha256", no_hashing)
        m.setattr(hashlib, "sha256", no_hashing)
        rows = CheckpointStore(tmp_path).list()
    assert [r.name for r in rows] == ["checkpoint-2", "checkpoint-4"]
    history = trainer.state.log_history
    evals = {h["step"]: h for h in history if "eval_loss" in h}
    best_step = min(evals, key=lambda s: evals[s]["eval_loss"])
    for row in rows:
        folder = tmp_path / row.name
        assert row.path == str(folder) and row.step == int(row.name.split("-")[1])
        assert row.epoch == pytest.approx(evals[row.step]["epoch"])
        assert row.metrics["eval_loss"] == evals[row.step]["eval_loss"]
        assert all(k.startswith("eval_") for k in row.metrics)
        on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
        assert row.size == on_disk
        assert t0 <= row.created <= t1
        assert row.complete is True and row.verified is None and row.problem is None
        assert row.best == (row.step == best_step)
        assert row.protected == (row.best or row.step == 4)

    # list() reads the manifest only: a flipped byte shows up in verify(), not in list()
    flip_byte(tmp_path / "checkpoint-2" / "model.safetensors")
    assert all(r.complete for r in CheckpointStore(tmp_path).list())
    ok, why = CheckpointStore(tmp_path).verify(tmp_path / "checkpoint-2")
    assert not ok and "model.safetensors" in why

    capsys.readouterr()
    assert cli_main(["checkpoints", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in printed] == ["checkpoint-2", "checkpoint-4"]
    assert set(printed[0]) == {"name", "path", "step", "epoch", "metrics", "size", "created", "complete",
                               "verified", "best", "protected", "problem", "edits", "edit_count", "foreign",
                               "state", "hashes_checked"}
    assert printed[1]["metrics"]["eval_loss"] == evals[4]["eval_loss"]
    assert printed[1]["size"] == rows[1].size
    # The command verifies the hashes: the flipped byte shows, and the damaged one is not complete.
    assert (printed[0]["state"], printed[0]["complete"], printed[0]["verified"]) == ("DAMAGED", False, False)
    assert "model.safetensors" in printed[0]["problem"] and printed[0]["hashes_checked"] is True
    assert (printed[1]["state"], printed[1]["complete"], printed[1]["verified"]) == ("verified", True, True)
    assert cli_main(["checkpoints", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "checkpoint-2" in table and "checkpoint-4" in table and "*best" in table and "complete" not in table
    assert "DAMAGED" in table and "verified" in table
    assert cli_main(["checkpoints", str(tmp_path / "missing")]) == 2


# ------------------------------------------------------------------ 11. sharded weights


def test_sharded_weights_are_written_with_an_index(tmp_path):
    model = gpt(0)
    save_model_files(model, tmp_path, max_shard_bytes=4096)
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as wte.weight
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    fresh = gpt(11)
    ckpt_state.load_model_files(fresh, tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert fresh.lm_head.weight is fresh.wte.weight


def test_resume_from_sharded_checkpoint_is_bitwise(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_state, "SHARD_BYTES", 4096)
    full = run(tmp_path / "full", max_steps=10)
    run(tmp_path / "cut", max_steps=10, stop=6)
    folder = tmp_path / "cut" / "checkpoint-6"
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    resumed = run(tmp_path / "cut", max_steps=10, resume=True, model_seed=8)
    assert resumed.model.lm_head.weight is resumed.model.wte.weight
    assert_same_run(full, resumed)
