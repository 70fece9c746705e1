"""Checkpoints that must not be trusted: a flipped byte, a truncated file, a missing manifest,
crafted pickles (refused without running), an output folder that cannot be written, a save
that fails mid-run, and the sentinel that marks a checkpoint still being written. Nothing
damaged is resumed from and nothing saved earlier is lost.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

import workbench.checkpoint.store as ckpt
import workbench.checkpoint.trainer_state as ckpt_state
from workbench import TrainerCallback
from workbench.checkpoint.store import CheckpointStore

from support import weights
from support.checkpointing import checkpoint_names, gpt, logged, reseal, run
from support.damage import flip_byte

# ------------------------------------------------------------------ 4. corruption


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """An uninterrupted run with checkpoint-4 and checkpoint-8 (save_steps=4)."""
    out = tmp_path_factory.mktemp("pristine") / "out"
    trainer = run(out, max_steps=8, save_strategy="steps", save_steps=4)
    assert checkpoint_names(out) == ["checkpoint-4", "checkpoint-8"]
    return {"out": out, "weights": weights(trainer), "losses": logged(trainer)}


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
    for name, value in weights(trainer).items():
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
