"""Checkpoints both ways with transformers' Trainer (issue 16, item 10).

A small BERT classifier built from a config (no download), sequential data and no dropout:
transformers' Trainer and workbench's take bitwise the same steps on CPU, so a run that
switches Trainer at a checkpoint must end with bitwise the same weights as one that never
did. Also: training_args.bin is written (and never read by workbench), and a checkpoint
whose files changed after sealing names the file and the command that accepts the change.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

from workbench import Trainer, TrainingArguments  # noqa: E402
from workbench.checkpoint.store import CheckpointStore  # noqa: E402
from workbench.checkpoint.trainer_state import save_model_files  # noqa: E402

from support import REPO, assert_same_weights, tiny_bert, token_rows, weights

OPTIONS = dict(max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, report_to="none",
               save_strategy="steps", save_steps=3, logging_steps=1, use_cpu=True, seed=0,
               train_sampling_strategy="sequential", disable_tqdm=True)


model, rows = tiny_bert, token_rows


def hf_trainer(out: Path) -> transformers.Trainer:
    return transformers.Trainer(model=model(), args=transformers.TrainingArguments(str(out), **OPTIONS),
                                train_dataset=rows())


def wb_trainer(out: Path) -> Trainer:
    return Trainer(model=model(), args=TrainingArguments(str(out), **OPTIONS), train_dataset=rows())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, object]:
    """The same 6 steps by each Trainer, uninterrupted; each saves at step 3 on the way."""
    root = tmp_path_factory.mktemp("reference")
    hf = hf_trainer(root / "hf")
    hf.train()
    wb = wb_trainer(root / "wb")
    wb.train()
    assert_same_weights(weights(hf), weights(wb))  # the premise: the two take the same steps
    return {"root": root, "weights": weights(wb), "losses": [e["loss"] for e in wb.state.log_history if "loss" in e]}


def test_workbench_resumes_from_a_checkpoint_transformers_wrote(reference, tmp_path, caplog):
    hf_checkpoint = reference["root"] / "hf" / "checkpoint-3"
    assert not (hf_checkpoint / "manifest.json").exists() and (hf_checkpoint / "training_args.bin").is_file()
    # `workbench run --resume PATH` checks it before any work: accepted as a transformers checkpoint.
    from workbench.cli.output_dir import check_resume_path as _check_resume_path

    _check_resume_path(hf_checkpoint)
    # An explicit path: a structural check, then a resume with a warning that it is unverified.
    resumed = wb_trainer(tmp_path / "explicit")
    with caplog.at_level("WARNING", logger="workbench"):
        resumed.train(resume_from_checkpoint=str(hf_checkpoint))
    assert "has no manifest.json (written by transformers' Trainer?): resuming from it unverified" in caplog.text
    assert_same_weights(weights(resumed), reference["weights"])
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e] == reference["losses"]

    # True: the newest checkpoint of an output_dir that holds only HF checkpoints, here with
    # weights resharded into two files (the layout large models have).
    out = tmp_path / "only-hf"
    shutil.copytree(hf_checkpoint, out / "checkpoint-3")
    state = {k: v for k, v in hf_trainer(tmp_path / "unused").model.state_dict().items()}
    (out / "checkpoint-3" / "model.safetensors").unlink()
    from safetensors.torch import load_file

    saved = load_file(str(hf_checkpoint / "model.safetensors"))
    save_model_files(torch.nn.Module(), out / "checkpoint-3", state=saved, max_shard_bytes=20_000)
    assert len(list((out / "checkpoint-3").glob("model-*-of-*.safetensors"))) > 1
    del state
    again = wb_trainer(out)
    again.train(resume_from_checkpoint=True)
    assert_same_weights(weights(again), reference["weights"])


def test_transformers_resumes_from_a_checkpoint_workbench_wrote(reference, tmp_path):
    wb_checkpoint = reference["root"] / "wb" / "checkpoint-3"
    assert (wb_checkpoint / "manifest.json").is_file()
    state = json.loads((wb_checkpoint / "trainer_state.json").read_text())
    assert "live_edits" not in state  # workbench's own fields live in workbench_state.json
    resumed = hf_trainer(tmp_path / "hf")
    resumed.train(resume_from_checkpoint=str(wb_checkpoint))
    assert_same_weights(weights(resumed), reference["weights"])


def test_training_args_bin_is_written_for_the_tools_that_read_it(reference):
    path = reference["root"] / "wb" / "checkpoint-3" / "training_args.bin"
    args = torch.load(path, weights_only=False)  # a tool reading it; workbench never does
    assert args.max_steps == 6 and args.learning_rate == 1e-2
    source = "\n".join(p.read_text() for p in (REPO / "workbench").rglob("*.py"))
    assert "training_args.bin\", weights_only=False" not in source


def test_a_changed_file_names_itself_and_reseal_accepts_it(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference["root"] / "wb" / "checkpoint-3", out / "checkpoint-3")
    folder = out / "checkpoint-3"
    # A user script reshards the weights after the checkpoint was sealed.
    from safetensors.torch import load_file

    saved = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    save_model_files(torch.nn.Module(), folder, state=saved, max_shard_bytes=20_000)
    ok, why = CheckpointStore(out).verify(folder)
    assert not ok and "model.safetensors is missing" in why
    assert f"workbench checkpoints {out} --reseal checkpoint-3" in why

    command = [sys.executable, "-m", "workbench", "checkpoints", str(out), "--reseal", "checkpoint-3"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "model.safetensors: is missing" in result.stdout and "model.safetensors.index.json" in result.stdout
    assert CheckpointStore(out).verify(folder) == (True, None)
    resumed = wb_trainer(out)
    resumed.train(resume_from_checkpoint=str(folder))
    assert_same_weights(weights(resumed), reference["weights"])
