"""Checkpoints: exact resume, data skip and model-only saves, rotation with the best kept,
load_best_model_at_end, leftovers, stateful callbacks, save_checkpoint, background saves and
optimizer group layouts. Damaged checkpoints are in test_checkpoint_damage.py, the
reference's examples, the catalog and sharded weights in test_checkpoint_reference.py.

All in-process and small (TinyGPT with 16-dim embeddings on 48 random token rows), so the
bitwise comparisons run in seconds; the SIGKILL fault test lives elsewhere (subprocesses).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench.checkpoint.trainer_state as ckpt_state
from workbench import TrainerCallback
from workbench.checkpoint.store import CheckpointStore
from workbench.checkpoint.trainer_state import save_checkpoint
from workbench.data.samplers import EpochRandomSampler, loader_samplers
from workbench.train.callbacks import EarlyStoppingCallback

from support import StopAt
from support.checkpointing import EVAL, StopAfterEval, assert_same_run, checkpoint_names, logged, run, run_scripted

# ------------------------------------------------------------------ 1. bitwise resume


@pytest.mark.parametrize("stop", [5, 12], ids=["mid-epoch", "epoch-boundary"])
def test_resume_at_step_boundary_is_bitwise_identical(tmp_path, stop):
    full = run(tmp_path / "full", max_steps=18)
    run(tmp_path / "cut", max_steps=18, stop=stop)
    assert checkpoint_names(tmp_path / "cut") == [f"checkpoint-{stop}"]
    resumed = run(tmp_path / "cut", max_steps=18, resume=True, model_seed=7)
    assert_same_run(full, resumed)
    assert resumed.state.epoch == pytest.approx(full.state.epoch)


def test_resume_mid_epoch_shuffle_dropout_workers_is_bitwise_identical(tmp_path):
    options = {"max_steps": 20, "dropout": 0.1, "dataloader_num_workers": 2, "train_sampling_strategy": "random"}
    full = run(tmp_path / "full", **options)
    run(tmp_path / "cut", stop=15, **options)  # 3 batches into the second epoch
    resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-15"), model_seed=3, **options)
    assert_same_run(full, resumed)
    # the shuffle really differs between epochs (the resumed epoch is not a replay of epoch 0)
    sampler = next(s for s in loader_samplers(resumed.get_train_dataloader()) if isinstance(s, EpochRandomSampler))
    sampler.set_epoch(0)
    first = list(iter(sampler))
    sampler.set_epoch(1)
    assert list(iter(sampler)) != first


def test_resume_with_gradient_accumulation_is_bitwise_identical(tmp_path):
    options = {"max_steps": 8, "dropout": 0.1, "gradient_accumulation_steps": 4}  # 3 updates an epoch
    full = run(tmp_path / "full", **options)
    run(tmp_path / "cut", stop=4, **options)
    resumed = run(tmp_path / "cut", resume=True, model_seed=5, **options)
    assert_same_run(full, resumed)


def test_resume_right_after_an_evaluation_is_bitwise_identical(tmp_path):
    options = {"max_steps": 12, "dropout": 0.1, "eval_strategy": "steps", "eval_steps": 3, "eval_dataset": EVAL}
    full = run(tmp_path / "full", **options)
    run(tmp_path / "cut", callbacks=[StopAfterEval(6)], **options)
    ckpt6 = tmp_path / "cut" / "checkpoint-6"
    saved_state = json.loads((ckpt6 / "trainer_state.json").read_text())
    assert any("eval_loss" in h and h["step"] == 6 for h in saved_state["log_history"])
    resumed = run(tmp_path / "cut", resume=True, model_seed=9, **options)
    assert_same_run(full, resumed)
    assert logged(full, "eval_loss") == logged(resumed, "eval_loss")
    assert [s for s, _ in logged(resumed, "eval_loss")] == [3, 6, 9, 12]  # step 6 not evaluated twice


# ------------------------------------------------------------- 2./3. data skip, model only


def test_ignore_data_skip_resumes_without_skipping(tmp_path):
    full = run(tmp_path / "full", max_steps=20)
    run(tmp_path / "cut", max_steps=20, stop=15)
    resumed = run(tmp_path / "cut", max_steps=20, resume=True, ignore_data_skip=True)
    assert resumed.state.global_step == 20
    assert [s for s, _ in logged(resumed)] == list(range(1, 21))
    assert logged(resumed)[:15] == logged(full)[:15]
    assert any(not torch.equal(p, q) for p, q in zip(full.model.parameters(), resumed.model.parameters()))
    # finished epochs are not repeated: the second epoch restarts at its first batch (as HF)
    epochs = [h["epoch"] for h in resumed.state.log_history if "loss" in h]
    assert epochs[15:] == pytest.approx([1 + i / 12 for i in range(1, 6)])


def test_save_only_model_resume_starts_a_fresh_optimizer(tmp_path):
    run(tmp_path, max_steps=10, stop=4, save_only_model=True)
    files = sorted(p.name for p in (tmp_path / "checkpoint-4").iterdir())
    assert "model.safetensors" in files and "trainer_state.json" in files and "manifest.json" in files
    for absent in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert absent not in files
    resumed = run(tmp_path, max_steps=10, resume=True, save_only_model=True)
    assert resumed.state.global_step == 10
    assert [s for s, _ in logged(resumed)] == list(range(1, 11))
    # Adam counted only the steps run after the resume: the optimizer started fresh
    steps = {float(entry["step"]) for entry in resumed.optimizer.state_dict()["state"].values()}
    assert steps == {6.0}


# ------------------------------------------------------- 7. rotation, best, load best


def test_save_total_limit_keeps_best_and_newest_and_loads_best(tmp_path):
    script = {2: 0.5, 4: 0.9, 6: 0.4, 8: 0.3, 10: 0.2, 12: 0.1}
    trainer = run_scripted(tmp_path, script, max_steps=12, eval_strategy="steps", eval_steps=2,
                           save_strategy="steps", save_steps=2, save_total_limit=1,
                           load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True)
    rows = CheckpointStore(tmp_path).list()
    assert [r.name for r in rows] == ["checkpoint-4", "checkpoint-12"]
    assert [r.best for r in rows] == [True, False]
    assert [r.protected for r in rows] == [True, True]
    assert trainer.state.best_metric == 0.9
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-4"
    best = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    final = trainer.model.state_dict()
    for name, value in best.items():
        assert torch.equal(final[name], value), name
    assert trainer.model.lm_head.weight is trainer.model.wte.weight
    last = load_file(str(tmp_path / "checkpoint-12" / "model.safetensors"))
    assert any(not torch.equal(last[k], best[k]) for k in best)


def test_save_total_limit_without_best_keeps_the_newest(tmp_path):
    run(tmp_path, max_steps=12, save_strategy="steps", save_steps=2, save_total_limit=2)
    assert checkpoint_names(tmp_path) == ["checkpoint-10", "checkpoint-12"]


def test_save_strategy_best_saves_only_on_improvement(tmp_path):
    script = {2: 0.5, 4: 0.9, 6: 0.4, 8: 0.95, 10: 0.1, 12: 0.2}
    trainer = run_scripted(tmp_path, script, max_steps=12, eval_strategy="steps", eval_steps=2,
                           save_strategy="best", metric_for_best_model="score", greater_is_better=True,
                           load_best_model_at_end=True)
    assert checkpoint_names(tmp_path) == ["checkpoint-2", "checkpoint-4", "checkpoint-8"]
    assert [r.best for r in CheckpointStore(tmp_path).list()] == [False, False, True]
    best = load_file(str(tmp_path / "checkpoint-8" / "model.safetensors"))
    final = trainer.model.state_dict()
    assert all(torch.equal(final[k], v) for k, v in best.items())


# ------------------------------------------------------------------ 8. leftovers


def test_leftover_temporaries_are_removed_when_training_starts(tmp_path, caplog):
    for name in (".tmp-checkpoint-3", ".trash-checkpoint-2-1234"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half written")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".tmp-checkpoint-2").write_text("a stray file where the save of step 2 goes")
    seen = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["names"] = sorted(os.listdir(args.output_dir))

    with caplog.at_level(logging.WARNING, logger="workbench"):
        run(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, callbacks=[Probe()])
    assert ".tmp-checkpoint-3" not in seen["names"] and ".trash-checkpoint-2-1234" not in seen["names"]
    assert "notes.txt" in seen["names"]
    remaining = sorted(os.listdir(tmp_path))
    assert not [n for n in remaining if n.startswith((".tmp-", ".trash-"))]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert CheckpointStore(tmp_path).verify(tmp_path / "checkpoint-2") == (True, None)
    assert any(".tmp-checkpoint-3" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ 13. callbacks


def test_restore_callback_states_restores_early_stopping(tmp_path):
    # the score only gets worse after step 1: with patience 3 the run stops at step 4
    script = {s: 1.0 - 0.1 * s for s in range(1, 11)}
    options = {"max_steps": 10, "eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "score",
               "greater_is_better": True}
    full = run_scripted(tmp_path / "full", script, callbacks=[EarlyStoppingCallback(3)], **options)
    assert full.state.global_step == 4

    run_scripted(tmp_path / "cut", script, callbacks=[EarlyStoppingCallback(3), StopAt(3)], **options)
    saved = json.loads((tmp_path / "cut" / "checkpoint-3" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] == 2

    seen = {}

    class Recording(EarlyStoppingCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.update(counter=self.early_stopping_patience_counter, patience=self.early_stopping_patience)
            super().on_train_begin(args, state, control, **kwargs)

    run_scripted(tmp_path / "rec", script, callbacks=[Recording(3), StopAt(3)], **options)
    # Resumed with the default patience (1): the saved args rebuild it with patience 3, as in HF.
    resumed = run_scripted(tmp_path / "rec", script, callbacks=[Recording()], resume=True,
                           restore_callback_states_from_checkpoint=True, **options)
    assert seen == {"counter": 2, "patience": 3}
    assert resumed.state.global_step == 4

    fresh = run_scripted(tmp_path / "cut", script, callbacks=[EarlyStoppingCallback(3)], resume=True, **options)
    # Without restoring, the counter starts over: steps 4, 5, 6 fail to beat the best (step 1's).
    assert fresh.state.global_step == 6


# ------------------------------------------------------------------ save_checkpoint API


def test_save_checkpoint_writes_hf_names_and_json_arguments(tmp_path):
    trainer = run(tmp_path, max_steps=2)
    path = save_checkpoint(trainer)
    assert path == tmp_path / "checkpoint-2"
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.json", "manifest.json"} <= names
    assert {"training_args.bin", "workbench_state.json"} <= names  # HF's pickle, for the tools that read it
    assert json.loads((path / "training_args.json").read_text())["max_steps"] == 2
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert CheckpointStore(tmp_path).verify(path) == (True, None)


# ------------------------------------------------------------------ 12. background saves (save_async)


def test_background_saves_publish_the_same_checkpoints_and_resume_bitwise(tmp_path):
    sync = run(tmp_path / "sync", max_steps=10, save_strategy="steps", save_steps=2, save_total_limit=2)
    background = run(tmp_path / "async", max_steps=10, save_strategy="steps", save_steps=2, save_total_limit=2,
                     save_async=True)
    assert_same_run(sync, background)
    store = CheckpointStore(tmp_path / "async")
    names = [c.name for c in store.list()]
    assert names == [c.name for c in CheckpointStore(tmp_path / "sync").list()] == ["checkpoint-8", "checkpoint-10"]
    assert all(store.verify(c.path) == (True, None) for c in store.list())  # published before train() returned
    for name in ("model.safetensors", "optimizer.pt"):
        assert (tmp_path / "async" / "checkpoint-8" / name).read_bytes() == \
            (tmp_path / "sync" / "checkpoint-8" / name).read_bytes()
    resumed = run(tmp_path / "async", max_steps=10, resume=str(tmp_path / "async" / "checkpoint-8"), save_async=True)
    assert_same_run(sync, resumed)


def test_background_save_writes_the_state_of_its_step_not_later_updates(tmp_path):
    trainer = run(tmp_path / "out", max_steps=2, save_strategy="no", save_async=True)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    gate = __import__("threading").Event()
    original = ckpt_state.CheckpointContents.write

    def slow_write(self, directory):
        gate.wait(10)  # the host copy is taken; the files are not written yet
        original(self, directory)

    ckpt_state.CheckpointContents.write = slow_write
    try:
        trainer.args.save_async = True
        path = save_checkpoint(trainer)
        assert not path.exists()  # still being written
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)  # training goes on meanwhile
        gate.set()
        trainer.checkpoint_writer.wait()
    finally:
        ckpt_state.CheckpointContents.write = original
    saved = load_file(str(path / "model.safetensors"))
    for name, value in saved.items():
        assert torch.equal(value, before[name]), name


def test_a_failed_background_save_is_raised_and_earlier_checkpoints_stay(tmp_path):
    class FailAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                ckpt_state.CheckpointContents.write = broken

    original = ckpt_state.CheckpointContents.write

    def broken(self, directory):
        raise OSError(28, "No space left on device")

    try:
        with pytest.raises(OSError, match="saving checkpoint-4 .* failed"):
            run(tmp_path / "out", max_steps=6, save_strategy="steps", save_steps=2, save_async=True,
                callbacks=[FailAt()])
    finally:
        ckpt_state.CheckpointContents.write = original
    store = CheckpointStore(tmp_path / "out")
    assert [c.name for c in store.list() if c.complete] == ["checkpoint-2"]
    assert not list((tmp_path / "out").glob(".tmp-*"))


# ------------------------------------------------------------------ 13. optimizer group layouts


def test_without_weight_decay_one_group_and_checkpoints_resume_across_layouts(tmp_path):
    plain = run(tmp_path / "no-decay", max_steps=4, save_strategy="steps", save_steps=2, weight_decay=0.0)
    assert len(plain.optimizer.param_groups) == 1  # one fused kernel launch per step, not two
    # A checkpoint without decay resumes with decay (two groups) and back.
    decayed = run(tmp_path / "no-decay", max_steps=6, resume=str(tmp_path / "no-decay" / "checkpoint-2"),
                  weight_decay=0.1, save_strategy="steps", save_steps=2)
    groups = decayed.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(decayed.optimizer.state[p]["step"] == 6 for g in groups for p in g["params"])
    assert len(decayed.lr_scheduler.base_lrs) == 2
    back = run(tmp_path / "no-decay", max_steps=8, resume=str(tmp_path / "no-decay" / "checkpoint-6"),
               weight_decay=0.0)
    assert len(back.optimizer.param_groups) == 1 and back.state.global_step == 8
    assert all(back.optimizer.state[p]["step"] == 8 for p in back.optimizer.param_groups[0]["params"])
