"""Checkpoints: exact resume, corruption and crafted pickles, save failures, rotation with
the best kept, load_best_model_at_end, leftovers, the catalog (API and CLI), sharded
weights, the sentinel, stateful callbacks and the reference's checkpoint examples.

All in-process and small (TinyGPT with 16-dim embeddings on 48 random token rows), so the
bitwise comparisons run in seconds; the SIGKILL fault test lives elsewhere (subprocesses).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import pickle
import resource
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from workbench import Trainer, TrainerCallback, TrainingArguments
import workbench.checkpoint.store as ckpt
import workbench.checkpoint.trainer_state as ckpt_state
from workbench.train.callbacks import EarlyStoppingCallback
from workbench.checkpoint.store import CheckpointStore
from workbench.checkpoint.trainer_state import save_checkpoint, save_model_files
from workbench.cli import main as cli_main
from workbench.data.builtin import TensorDictDataset
from workbench.data.samplers import EpochRandomSampler, loader_samplers
from workbench.models import TinyGPT

from conftest import StopAt
from conftest import make_args as _make_args

# Small batches, a fast learning rate and a fixed seed for every run in this file.
make_args = functools.partial(_make_args, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                              learning_rate=1e-2, seed=1)

VOCAB = 40
SEQ = 16
N_TRAIN = 48  # batch 4 -> 12 micro-batches an epoch


# ----------------------------------------------------------------------------- helpers


def token_rows(n: int, seed: int) -> TensorDictDataset:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    return TensorDictDataset(input_ids=ids, labels=ids.clone())


TRAIN = token_rows(N_TRAIN, 0)
EVAL = token_rows(8, 1)


def gpt(seed: int = 0, **overrides) -> TinyGPT:
    torch.manual_seed(seed)
    options = {"vocab_size": VOCAB, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": SEQ}
    options.update(overrides)
    return TinyGPT(**options)


class StopAfterEval(TrainerCallback):
    """Ask for save + stop right after the evaluation at step ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_save = True
            control.should_training_stop = True


def run(out, *, max_steps: int, stop: int | None = None, resume=None, model_seed: int = 0,
        dropout: float = 0.0, callbacks=(), eval_dataset=None, compute_metrics=None, model=None,
        **overrides) -> Trainer:
    model = model if model is not None else gpt(model_seed, dropout=dropout)
    args = make_args(out, max_steps=max_steps, **overrides)
    cbs = list(callbacks) + ([StopAt(stop)] if stop else [])
    trainer = Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=eval_dataset,
                      compute_metrics=compute_metrics, callbacks=cbs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(trainer: Trainer, key: str = "loss") -> list[tuple[int, float]]:
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def assert_same_run(a: Trainer, b: Trainer) -> None:
    """Bitwise: every parameter, every optimizer state tensor, the logged losses."""
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    n_tensors = 0
    for index, entry in sa["state"].items():
        assert entry.keys() == sb["state"][index].keys()
        for key, value in entry.items():
            other = sb["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"optimizer state {index}/{key} differs"
                n_tensors += 1
            else:
                assert value == other
    assert n_tensors > 0
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]
    assert logged(a) == logged(b)
    assert a.state.global_step == b.state.global_step


def weights_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def checkpoint_names(out) -> list[str]:
    return [info.name for info in CheckpointStore(out).list()]


def reseal(checkpoint: Path) -> None:
    """Rewrite manifest.json for the files as they are now (a deliberate forgery)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for rel in manifest["files"]:
        data = (checkpoint / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) - 5 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


class ScriptedMetric:
    """compute_metrics returning a chosen value per step: {"score": script[global_step]}."""

    def __init__(self, script: dict[int, float], name: str = "score") -> None:
        self.script, self.name = script, name
        self.trainer: Trainer | None = None

    def __call__(self, pred):
        return {self.name: self.script[self.trainer.state.global_step]}


def run_scripted(out, script, *, max_steps, callbacks=(), resume=None, **overrides) -> Trainer:
    metric = ScriptedMetric(script)
    args = make_args(out, max_steps=max_steps, **overrides)
    trainer = Trainer(model=gpt(0), args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                      compute_metrics=metric, callbacks=list(callbacks))
    metric.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer


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


# ------------------------------------------------------------------ 4. corruption


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """An uninterrupted run with checkpoint-4 and checkpoint-8 (save_steps=4)."""
    out = tmp_path_factory.mktemp("pristine") / "out"
    trainer = run(out, max_steps=8, save_strategy="steps", save_steps=4)
    assert checkpoint_names(out) == ["checkpoint-4", "checkpoint-8"]
    return {"out": out, "weights": weights_of(trainer), "losses": logged(trainer)}


@pytest.fixture
def outdir(tmp_path, pristine):
    out = tmp_path / "out"
    shutil.copytree(pristine["out"], out)
    return out


def resume_and_check_fell_back(out, pristine, caplog, skipped_reason: str) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workbench"):
        trainer = run(out, max_steps=8, save_strategy="steps", save_steps=4, resume=True, model_seed=4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("checkpoint-8" in w and skipped_reason in w for w in warnings), warnings
    # resumed from checkpoint-4: steps 5..8 were trained again, ending where the full run ended
    assert logged(trainer) == pristine["losses"]
    for name, value in weights_of(trainer).items():
        assert torch.equal(value, pristine["weights"][name]), name
    assert CheckpointStore(out).verify(out / "checkpoint-8") == (True, None)  # re-saved cleanly


def test_flipped_byte_is_detected_and_skipped(outdir, pristine, caplog):
    flip_byte(outdir / "checkpoint-8" / "model.safetensors")
    ok, why = CheckpointStore(outdir).verify(outdir / "checkpoint-8")
    assert not ok and "model.safetensors" in why and "sha256" in why
    assert CheckpointStore(outdir).verify(outdir / "checkpoint-4") == (True, None)
    resume_and_check_fell_back(outdir, pristine, caplog, "model.safetensors")


def test_truncated_file_is_detected_and_skipped(outdir, pristine, caplog):
    target = outdir / "checkpoint-8" / "optimizer.pt"
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size // 2)
    ok, why = CheckpointStore(outdir).verify(outdir / "checkpoint-8")
    assert not ok and "optimizer.pt" in why and str(size) in why
    resume_and_check_fell_back(outdir, pristine, caplog, "optimizer.pt")


def test_checkpoint_without_manifest_is_incomplete_and_skipped(outdir, pristine, caplog):
    (outdir / "checkpoint-8" / "manifest.json").unlink()
    rows = {r.name: r for r in CheckpointStore(outdir).list()}
    assert rows["checkpoint-8"].complete is False and rows["checkpoint-4"].complete is True
    ok, why = CheckpointStore(outdir).verify(outdir / "checkpoint-8")
    assert not ok and "manifest" in why
    resume_and_check_fell_back(outdir, pristine, caplog, "skipping")


def test_resume_from_a_corrupt_path_raises_a_clear_error(outdir):
    flip_byte(outdir / "checkpoint-8" / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint-8.*model\.safetensors"):
        run(outdir, max_steps=8, resume=str(outdir / "checkpoint-8"))
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        run(outdir, max_steps=8, resume=str(outdir / "checkpoint-99"))


def test_no_valid_checkpoint_raises(outdir, tmp_path):
    flip_byte(outdir / "checkpoint-8" / "model.safetensors")
    (outdir / "checkpoint-4" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        run(outdir, max_steps=8, resume=True)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        run(tmp_path / "empty", max_steps=8, resume=True)


# ------------------------------------------------------------------ 5. crafted pickle


class _OpenCanary:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _SystemCanary:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("target,payload,writer", [
    ("optimizer.pt", _OpenCanary, "torch.save"),
    ("optimizer.pt", _SystemCanary, "pickle"),
    ("rng_state.pth", _OpenCanary, "pickle"),
])
def test_crafted_pickle_is_refused_without_running(outdir, tmp_path, target, payload, writer):
    canary = tmp_path / "canary"
    evil = payload(str(canary))
    path = outdir / "checkpoint-8" / target
    if writer == "torch.save":
        torch.save({"state": evil}, path)
    else:
        path.write_bytes(pickle.dumps(evil, protocol=2))
    assert not canary.exists()
    reseal(outdir / "checkpoint-8")
    assert CheckpointStore(outdir).verify(outdir / "checkpoint-8") == (True, None)
    with pytest.raises(Exception, match=target.replace(".", r"\.")) as info:
        run(outdir, max_steps=8, resume=True)
    assert not canary.exists(), "the pickle's payload ran"
    assert "weights_only" in str(info.value) or "refused" in str(info.value)


# ------------------------------------------------------------------ 6. unwritable


def test_output_dir_under_a_regular_file_gives_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "out"
    with pytest.raises(OSError, match="output_dir") as info:
        run(out, max_steps=2, save_strategy="steps", save_steps=1)
    assert str(out) in str(info.value)
    assert blocker.read_text() == "not a folder"


class FillDiskAt(TrainerCallback):
    """From step ``n`` on, files may not grow past ``headroom`` bytes beyond events.jsonl
    (RLIMIT_FSIZE: the kernel answers EFBIG, as a full disk answers ENOSPC)."""

    def __init__(self, n: int, headroom: int) -> None:
        self.n, self.headroom = n, headroom

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            events = Path(args.output_dir) / "events.jsonl"
            limit = events.stat().st_size + self.headroom
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_failed_save_mid_run_leaves_earlier_checkpoints_intact(tmp_path):
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    options = {"max_steps": 8, "save_strategy": "steps", "save_steps": 4}
    big = {"n_embd": 64}  # ~200 KB of weights: more than the headroom
    try:
        with pytest.raises(OSError) as info:
            run(tmp_path, model=gpt(0, **big), callbacks=[FillDiskAt(8, 64 * 1024)], **options)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(info.value)
    assert "checkpoint-8" in message and str(tmp_path) in message and "intact" in message
    store = CheckpointStore(tmp_path)
    assert [r.name for r in store.list()] == ["checkpoint-4"]
    assert store.verify(tmp_path / "checkpoint-4") == (True, None)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    resumed = run(tmp_path, model=gpt(2, **big), resume=True, **options)
    assert resumed.state.global_step == 8
    assert [r.name for r in store.list()] == ["checkpoint-4", "checkpoint-8"]


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


# ------------------------------------------------------------------ 12. sentinel


def test_sentinel_exists_during_the_write_only(tmp_path, monkeypatch):
    seen = []
    original = ckpt_state.save_model_files

    def spy(model, directory, *args, **kwargs):
        seen.append((directory.name, (directory / ckpt.SENTINEL).is_file(), directory.parent.name))
        return original(model, directory, *args, **kwargs)

    monkeypatch.setattr(ckpt_state, "save_model_files", spy)
    run(tmp_path / "out", max_steps=4, save_strategy="steps", save_steps=2)
    assert seen == [(".tmp-checkpoint-2", True, "out"), (".tmp-checkpoint-4", True, "out")]
    for name in ("checkpoint-2", "checkpoint-4"):
        folder = tmp_path / "out" / name
        assert not (folder / ckpt.SENTINEL).exists()
        assert ckpt.SENTINEL not in json.loads((folder / "manifest.json").read_text())["files"]


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
