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
        names, hf_names = {p.name for p in ours.iterdir()}, {p.name for p in theirs.iterdir()}
        # Both ways: workbench adds its own files only, and drops none transformers writes.
        assert names - hf_names == WORKBENCH_ONLY, f"files only workbench writes: {names - hf_names}"
        assert hf_names - names == set(), f"files transformers writes and workbench does not: {hf_names - names}"
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


# -- answer tokens through a config-built LoRA run -------------------------------------------

LORA_CHAT_CONFIG = """\
[model]
pretrained = "{model}"
[model.peft]
r = 4
lora_alpha = 8
target_modules = ["q_proj", "v_proj"]
[data]
train = {{ path = "{train}" }}
format = "{format}"
[training]
output_dir = "out"
per_device_train_batch_size = 4
gradient_accumulation_steps = 2
max_steps = 2
train_sampling_strategy = "sequential"
learning_rate = 1e-2
save_strategy = "no"
report_to = "none"
disable_tqdm = true
"""


def _answers(row: dict, tokenizer) -> str:
    """The text a row trains on, from the row itself: the assistant's turns with their end
    token (messages), or the completion and eos (prompt-completion)."""
    if "messages" in row:
        return "".join(m["content"] + "<|end|>" for m in row["messages"] if m["role"] == "assistant")
    return row["completion"] + tokenizer.eos_token


@pytest.mark.parametrize("format", ["messages", "prompt-completion"])
def test_a_lora_run_on_chat_data_trains_the_answer_tokens_only(finetune_workspace, tmp_path, format):
    """``[model.peft]`` with chat data, as ``workbench run`` builds it: each micro-batch's
    trained tokens are the answers of its rows, and the ``num_items_in_batch`` the PEFT model's
    loss divides by is the step's count of them."""
    from workbench.config.build import build_trainer
    from workbench.config.loader import load_config

    train = finetune_workspace.chat if format == "messages" else finetune_workspace.completions
    path = tmp_path / "cfg.toml"
    path.write_text(LORA_CHAT_CONFIG.format(model=finetune_workspace.model, train=train, format=format))
    trainer = build_trainer(load_config(path), progress=False)
    assert is_peft_model(unwrap_model(trainer.model))
    tokenizer = trainer.processing_class
    seen: list[dict] = []

    def record(module, args, kwargs, output):
        seen.append({"items": int(kwargs["num_items_in_batch"]), "ids": kwargs["input_ids"].clone(),
                     "labels": kwargs["labels"].clone()})

    unwrap_model(trainer.model).register_forward_hook(record, with_kwargs=True)
    trainer.train()
    assert len(seen) == 4  # 2 steps of 2 micro-batches of 4 rows, in the file's order
    rows = [json.loads(line) for line in train.read_text().splitlines()][:16]
    for step in range(2):
        micro = seen[2 * step: 2 * step + 2]
        trained = [m["labels"] != -100 for m in micro]
        count = sum(int(t.sum()) for t in trained)
        assert [m["items"] for m in micro] == [count, count]
        for k, (m, mask) in enumerate(zip(micro, trained)):
            assert torch.equal(m["labels"][mask], m["ids"][mask])  # a trained label is the token itself
            for j in range(4):
                row = rows[8 * step + 4 * k + j]
                text = tokenizer.decode(m["ids"][j][mask[j]].tolist(), skip_special_tokens=False)
                assert text == _answers(row, tokenizer), (step, k, j)
