"""``workbench export``: a checkpoint as a folder transformers' own ``from_pretrained`` loads --
the adapter with its base named, the adapter merged into the base, or full weights -- with the
trained model's logits, and every refusal one line with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import workbench  # noqa: E402
from workbench.cli import main  # noqa: E402
from workbench.core.trainer_utils import unwrap_model  # noqa: E402
from workbench.data.collators import DataCollatorForLanguageModeling  # noqa: E402

from support.finetune import assert_merged_logits, chat_lm_dataset, lora_model  # noqa: E402


def _train(model, workspace, out: Path):
    data, tokenizer = chat_lm_dataset(workspace.model)
    args = workbench.TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=4,
                                       learning_rate=5e-2, save_steps=4, report_to=[], seed=0, use_cpu=True,
                                       disable_tqdm=True)
    trainer = workbench.Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    return trainer, out / "checkpoint-4"


@pytest.fixture(scope="module")
def trained(finetune_workspace, tmp_path_factory):
    """A LoRA run's checkpoint, its trained model (eval mode) and a batch to compare logits on."""
    trainer, checkpoint = _train(lora_model(finetune_workspace.model, dropout=0.0), finetune_workspace,
                                 tmp_path_factory.mktemp("lora"))
    data, _ = chat_lm_dataset(finetune_workspace.model, rows=4)
    batch = torch.tensor([row[:12] for row in data["input_ids"]])
    model = unwrap_model(trainer.model).eval()
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    return checkpoint, batch, logits


def _logits(model, batch):
    with torch.no_grad():
        return model.eval()(input_ids=batch).logits


def test_merge_gives_a_plain_transformers_model_with_the_trained_logits(trained, finetune_workspace, tmp_path,
                                                                       capsys):
    checkpoint, batch, logits = trained
    assert main(["export", str(checkpoint), str(tmp_path / "merged"), "--merge"]) == 0
    assert "merged" in capsys.readouterr().out
    names = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith("adapter") for n in names)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = transformers.AutoModelForCausalLM.from_pretrained(finetune_workspace.model)
    assert_merged_logits(_logits(model, batch), logits, _logits(base, batch))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer.chat_template


def test_an_adapter_export_names_its_base_and_loads_with_peft(trained, finetune_workspace, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel

    checkpoint, batch, logits = trained
    out = tmp_path / "adapter"
    assert main(["export", str(checkpoint), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= names
    named = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(named).resolve() == finetune_workspace.model.resolve()
    # Through the base the export names, as a user of the folder loads it (peft reads the name
    # from adapter_config.json): no merge, so the very logits of the trained model.
    model = AutoPeftModelForCausalLM.from_pretrained(out)
    assert isinstance(model, PeftModel)
    assert torch.equal(_logits(model, batch), logits)
    # And with the base given by hand, as the adapter's own loader takes it.
    base = transformers.AutoModelForCausalLM.from_pretrained(named)
    assert torch.equal(_logits(PeftModel.from_pretrained(base, out), batch), logits)


def test_a_full_checkpoint_exports_its_weights(finetune_workspace, tmp_path):
    base = transformers.AutoModelForCausalLM.from_pretrained(finetune_workspace.model)
    trainer, checkpoint = _train(base, finetune_workspace, tmp_path / "full")
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    batch = torch.tensor([[1, 5, 9, 12]])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(_logits(loaded, batch), _logits(unwrap_model(trainer.model), batch))


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("workbench: ")
    return err


def test_every_refusal_is_one_line_and_writes_nothing(trained, tmp_path, capsys):
    checkpoint, _, _ = trained
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert "already exists and is not empty" in _refused(capsys, ["export", str(checkpoint), str(busy)])
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert "is not a folder" in _refused(capsys, ["export", str(tmp_path / "nope"), str(tmp_path / "o1")])
    damaged = tmp_path / "run" / checkpoint.name
    shutil.copytree(checkpoint, damaged)
    with open(damaged / "adapter_model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    assert "is damaged" in _refused(capsys, ["export", str(damaged), str(tmp_path / "o2")])
    gone = tmp_path / "gone" / checkpoint.name
    shutil.copytree(checkpoint, gone)
    (gone / "manifest.json").unlink()
    data = json.loads((gone / "adapter_config.json").read_text())
    data["base_model_name_or_path"] = "/nowhere/tiny-llama"
    (gone / "adapter_config.json").write_text(json.dumps(data))
    assert "is not a folder on this machine" in _refused(capsys, ["export", str(gone), str(tmp_path / "o3")])
    assert not any(p.name.startswith(("o1", "o2", "o3", ".o")) for p in tmp_path.iterdir())


def test_merge_without_an_adapter_and_a_model_transformers_cannot_load_are_refused(tmp_path, capsys):
    from support.lm import lm_trainer

    trainer = lm_trainer(tmp_path / "builtin", max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    checkpoint = tmp_path / "builtin" / "checkpoint-2"
    assert "no LoRA adapter to merge" in _refused(capsys, ["export", str(checkpoint), str(tmp_path / "a"), "--merge"])
    assert "no config.json" in _refused(capsys, ["export", str(checkpoint), str(tmp_path / "b")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
