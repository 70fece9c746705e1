"""LoRA adapters through peft in workbench's Trainer, side by side with transformers' Trainer:
the same losses, the same checkpoint files (the adapter, not the frozen base), optimizer
state of the trainable parameters only, a bitwise resume, and the reports that tell trained
from frozen parameters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import workbench  # noqa: E402
from workbench.checkpoint.trainer_state import weights_misfit  # noqa: E402
from workbench.core.trainer_utils import unwrap_model  # noqa: E402
from workbench.data.collators import DataCollatorForLanguageModeling  # noqa: E402
from workbench.models.adapters import is_peft_model, parameter_split  # noqa: E402
from workbench.session.inspection import inspect_model  # noqa: E402
from workbench.train.memory import memory_report  # noqa: E402

from support.finetune import chat_lm_dataset, lora_model  # noqa: E402

WORKBENCH_ONLY = {"manifest.json", "training_args.json", "workbench_state.json"}


def _arguments(cls, out: Path, **extra):
    return cls(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, save_steps=3,
               logging_steps=1, report_to=[], seed=0, use_cpu=True, **extra)


def _run(trainer_cls, args_cls, collator_cls, workspace, out: Path, resume: str | None = None, **extra):
    data, tokenizer = chat_lm_dataset(workspace.model)
    trainer = trainer_cls(model=lora_model(workspace.model), args=_arguments(args_cls, out, **extra),
                          train_dataset=data, data_collator=collator_cls(tokenizer, mlm=False),
                          processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def side_by_side(finetune_workspace, tmp_path_factory):
    """One LoRA run (dropout on) through each Trainer."""
    root = tmp_path_factory.mktemp("peft")
    ours = _run(workbench.Trainer, workbench.TrainingArguments, DataCollatorForLanguageModeling, finetune_workspace,
                root / "workbench")
    theirs = _run(transformers.Trainer, transformers.TrainingArguments, transformers.DataCollatorForLanguageModeling,
                  finetune_workspace, root / "transformers")
    return ours, theirs, root


def test_a_peft_model_trains_with_transformers_losses(side_by_side):
    ours, theirs, _ = side_by_side
    assert is_peft_model(unwrap_model(ours.model))
    assert _losses(ours) == _losses(theirs) and len(_losses(ours)) == 6


def test_checkpoints_hold_the_adapter_as_transformers_writes_it(side_by_side):
    _, _, root = side_by_side
    for step in (3, 6):
        ours, theirs = root / "workbench" / f"checkpoint-{step}", root / "transformers" / f"checkpoint-{step}"
        names = {p.name for p in ours.iterdir()}
        assert names - {p.name for p in theirs.iterdir()} == WORKBENCH_ONLY
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names
        mine, hf = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
        assert mine.keys() == hf.keys() and all(torch.equal(mine[k], hf[k]) for k in mine)
        config = json.loads((ours / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["target_modules"] and Path(config["base_model_name_or_path"]).is_dir()
        manifest = json.loads((ours / "manifest.json").read_text())["files"]
        assert {"adapter_model.safetensors", "adapter_config.json"} <= manifest.keys()


def test_optimizer_state_covers_the_trainable_parameters_only(side_by_side):
    ours, _, root = side_by_side
    trained, frozen = parameter_split(unwrap_model(ours.model))
    assert frozen > 10 * trained > 0
    state = torch.load(root / "workbench" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    adapters = [p for p in unwrap_model(ours.model).parameters() if p.requires_grad]
    assert len(state["state"]) == len(adapters) == 8
    assert sum(s["exp_avg"].numel() for s in state["state"].values()) == trained


def test_a_checkpoint_is_a_small_fraction_of_the_full_model(side_by_side, finetune_workspace):
    _, _, root = side_by_side
    adapter = (root / "workbench" / "checkpoint-6" / "adapter_model.safetensors").stat().st_size
    full = (finetune_workspace.model / "model.safetensors").stat().st_size
    assert adapter * 10 < full


def test_a_resumed_peft_run_ends_with_bitwise_equal_adapter_weights(side_by_side, finetune_workspace, tmp_path):
    _, _, root = side_by_side
    out = tmp_path / "resumed"
    shutil.copytree(root / "workbench" / "checkpoint-3", out / "checkpoint-3")
    resumed = _run(workbench.Trainer, workbench.TrainingArguments, DataCollatorForLanguageModeling,
                   finetune_workspace, out, resume=str(out / "checkpoint-3"))
    first, again = (load_file(p / "checkpoint-6" / "adapter_model.safetensors") for p in (root / "workbench", out))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert _losses(resumed)[3:] == _losses(side_by_side[0])[3:]


def test_transformers_trainer_resumes_from_a_workbench_peft_checkpoint(side_by_side, finetune_workspace, tmp_path):
    _, _, root = side_by_side
    out = tmp_path / "hf-resumed"
    shutil.copytree(root / "workbench" / "checkpoint-3", out / "checkpoint-3")
    _run(transformers.Trainer, transformers.TrainingArguments, transformers.DataCollatorForLanguageModeling,
         finetune_workspace, out, resume=str(out / "checkpoint-3"))
    first, again = (load_file(p / "checkpoint-6" / "adapter_model.safetensors") for p in (root / "transformers", out))
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_save_model_writes_the_adapter_folder(side_by_side, tmp_path):
    ours, _, _ = side_by_side
    ours.save_model(str(tmp_path / "final"))
    names = {p.name for p in (tmp_path / "final").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names


def test_a_checkpoint_of_another_adapter_or_none_is_refused_in_one_line(side_by_side, finetune_workspace):
    ours, _, root = side_by_side
    checkpoint = root / "workbench" / "checkpoint-3"
    assert weights_misfit(unwrap_model(ours.model), checkpoint) is None
    other = lora_model(finetune_workspace.model, r=8)
    assert "does not fit this run's [model.peft]" in weights_misfit(other, checkpoint)
    plain = transformers.AutoModelForCausalLM.from_pretrained(finetune_workspace.model)
    assert "holds a LoRA adapter" in weights_misfit(plain, checkpoint)
    assert "holds full weights" in weights_misfit(other, finetune_workspace.model)


def test_memory_report_and_inspect_tell_trained_from_frozen(side_by_side):
    ours, _, _ = side_by_side
    model = unwrap_model(ours.model)
    report = memory_report(model, ours.optimizer)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert report.parameters - report.frozen_parameters == trained and report.frozen_parameters > 0
    layers = inspect_model(ours)["layers"]
    assert sum(not r["trainable"] for r in layers) > sum(r["trainable"] for r in layers) == 8
    from workbench.widgets.tui.inspect import inspect_summary, memory_line
    from workbench.widgets.view import memory_rows

    assert "trained" in inspect_summary({"layers": layers})[0] and "frozen" in memory_line(report)
    assert [row.label for row in memory_rows(report)][:2] == ["trained", "frozen"]
