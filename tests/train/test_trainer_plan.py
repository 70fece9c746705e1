"""The Trainer's plan and its arguments: auto_find_batch_size, activation checkpointing, steps
and epochs, clear errors for a model without a loss, seeded reproducibility, and
TrainingArguments (defaults, validation, derived values, subclassing, JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from workbench import Trainer, TrainingArguments
from workbench.core.args.training import ArgumentError
from workbench.data.builtin import TensorDictDataset
from workbench.models import MLPClassifier, TinyGPT

from support import StopAt, make_args
from support.small import VOCAB, class_data, mlp, params, small_gpt, token_data, train_logs, update_norm

# ------------------------------------------------------------ 11. auto_find_batch_size


class OOMAbove4(MLPClassifier):
    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        if x.size(0) > 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x, labels, num_items_in_batch)


def test_auto_find_batch_size_retries_with_a_smaller_batch(tmp_path):
    train, _ = class_data(n=32)
    model = mlp(cls=OOMAbove4)
    before = params(model)
    args = make_args(tmp_path, auto_find_batch_size=True, per_device_train_batch_size=16, num_train_epochs=1,
                     optim="sgd", learning_rate=0.1)
    trainer = Trainer(model, args, train_dataset=train)
    trainer.train()
    assert trainer.state.train_batch_size == 4
    assert trainer.state.global_step == trainer.state.max_steps == 8
    assert update_norm(before, model) > 0
    # The LR schedule spans the retried run's 8 steps (not the 2 planned for batch 16).
    assert [e["learning_rate"] for e in train_logs(trainer)] == pytest.approx([0.1 * (1 - s / 8) for s in range(8)])


def test_auto_find_batch_size_resumes_with_the_batch_size_it_settled_on(tmp_path):
    # As HF: trainer_state.json keeps the batch size that worked, and a resume starts there
    # instead of failing down from per_device_train_batch_size again.
    train, _ = class_data(n=32)
    options = dict(auto_find_batch_size=True, per_device_train_batch_size=16, num_train_epochs=1, optim="sgd",
                   learning_rate=0.1, save_strategy="steps", save_steps=4)
    first = Trainer(mlp(cls=OOMAbove4), make_args(tmp_path, **options), train_dataset=train,
                    callbacks=[StopAt(4)])
    first.train()
    assert json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["train_batch_size"] == 4
    seen: list[int] = []

    class Recording(OOMAbove4):
        def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
            seen.append(x.size(0))
            return super().forward(x, labels, num_items_in_batch)

    resumed = Trainer(mlp(cls=Recording), make_args(tmp_path, **options), train_dataset=train)
    resumed.train(resume_from_checkpoint=True)
    assert seen and set(seen) == {4}  # no batch of 16 or 8 was tried
    assert resumed.state.train_batch_size == 4 and resumed.state.global_step == 8


def test_without_auto_find_batch_size_the_oom_propagates(tmp_path):
    train, _ = class_data(n=32)
    args = make_args(tmp_path, per_device_train_batch_size=16, num_train_epochs=1, optim="sgd")
    with pytest.raises(RuntimeError, match="out of memory"):
        Trainer(mlp(cls=OOMAbove4), args, train_dataset=train).train()


# ------------------------------------------------------------ 12. activation checkpointing


@pytest.mark.parametrize("flag", ["activation_checkpointing", "gradient_checkpointing"])
def test_activation_checkpointing_gives_the_same_weights(tmp_path, flag):
    def run(name, **extra):
        model = small_gpt()
        args = make_args(tmp_path / name, optim="adamw_torch", learning_rate=1e-2, max_steps=3,
                         per_device_train_batch_size=4, train_sampling_strategy="sequential", **extra)
        Trainer(model, args, train_dataset=token_data()).train()
        return model

    plain = run("plain")
    checkpointed = run("ckpt", **{flag: True})
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    for (name, a), b in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_activation_checkpointing_without_support_is_a_clear_error(tmp_path):
    train, _ = class_data(n=8)
    args = make_args(tmp_path, activation_checkpointing=True, max_steps=1, optim="sgd")
    with pytest.raises(ValueError, match="gradient_checkpointing_enable") as info:
        Trainer(mlp(), args, train_dataset=train).train()
    assert "MLPClassifier" in str(info.value)


# ------------------------------------------------------------ 13. steps and epochs


@pytest.mark.parametrize("n,options,global_step,epoch", [
    (32, {"num_train_epochs": 2}, 8, 2.0),  # 8 batches / 2 accumulated = 4 updates an epoch
    (32, {"num_train_epochs": 1.5}, 6, 1.5),
    (32, {"max_steps": 5, "num_train_epochs": 1}, 5, 1.25),  # max_steps wins over epochs
    (36, {"num_train_epochs": 1}, 5, 1.0),  # 9 batches: the last update has one micro-batch
])
def test_max_steps_and_epochs(tmp_path, n, options, global_step, epoch):
    train, _ = class_data(n=n)
    args = make_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="sgd",
                     logging_steps=100, **options)
    trainer = Trainer(mlp(), args, train_dataset=train)
    output = trainer.train()
    assert trainer.state.global_step == output.global_step == trainer.state.max_steps == global_step
    assert trainer.state.epoch == pytest.approx(epoch)


class Stream(IterableDataset):
    def __init__(self, data: TensorDictDataset) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def test_iterable_dataset_needs_max_steps(tmp_path):
    train, _ = class_data(n=16)
    args = make_args(tmp_path, per_device_train_batch_size=4, optim="sgd")
    with pytest.raises(ValueError, match="max_steps"):
        Trainer(mlp(), args, train_dataset=Stream(train)).train()
    # With max_steps it trains, cycling the stream (16 rows = 4 batches, 6 steps).
    args = make_args(tmp_path, per_device_train_batch_size=4, optim="sgd", max_steps=6)
    trainer = Trainer(mlp(), args, train_dataset=Stream(train))
    trainer.train()
    assert trainer.state.global_step == 6


def test_logging_and_eval_steps_as_ratios(tmp_path):
    train, evals = class_data(n=32, n_eval=8)
    args = make_args(tmp_path, per_device_train_batch_size=4, optim="sgd", max_steps=8, logging_steps=0.25,
                     eval_strategy="steps", eval_steps=0.5)
    trainer = Trainer(mlp(), args, train_dataset=train, eval_dataset=evals)
    trainer.train()
    assert trainer.state.logging_steps == 2 and trainer.state.eval_steps == 4
    assert [e["step"] for e in train_logs(trainer)] == [2, 4, 6, 8]
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [4, 8]


# ------------------------------------------------------------ 14. no loss: clear errors


class LogitsOnlyNoKind(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(x)


def test_model_without_loss_or_loss_type_is_a_clear_error(tmp_path):
    train, _ = class_data(n=8)
    args = make_args(tmp_path, max_steps=1, optim="sgd")
    with pytest.raises(ValueError, match="loss_type") as info:
        Trainer(LogitsOnlyNoKind(), args, train_dataset=train).train()
    assert "LogitsOnlyNoKind" in str(info.value) and "compute_loss_func" in str(info.value)


def test_model_returning_no_loss_without_labels_is_a_clear_error(tmp_path):
    train, _ = class_data(n=8)
    unlabeled = TensorDictDataset(x=train.tensors["x"])
    args = make_args(tmp_path, max_steps=1, optim="sgd")
    with pytest.raises(ValueError, match="did not return a loss"):
        Trainer(mlp(), args, train_dataset=unlabeled).train()
    # A bare logits tensor is not taken for a loss (its first row used to be).
    with pytest.raises(ValueError, match=r"did not return a loss \(it returned a tensor of shape \(8, 4\)\)"):
        Trainer(LogitsOnlyNoKind(), make_args(tmp_path, max_steps=1, optim="sgd", per_device_train_batch_size=8),
                train_dataset=unlabeled).train()


class ScalarLossModel(LogitsOnlyNoKind):
    def forward(self, x):
        return self.linear(x).pow(2).mean()


def test_model_returning_a_bare_scalar_loss_trains(tmp_path):
    train, _ = class_data(n=8)
    model = ScalarLossModel()
    before = params(model)
    args = make_args(tmp_path, max_steps=2, optim="sgd", learning_rate=0.1, per_device_train_batch_size=4)
    trainer = Trainer(model, args, train_dataset=TensorDictDataset(x=train.tensors["x"]))
    trainer.train()
    assert trainer.state.global_step == 2 and update_norm(before, model) > 0
    assert train_logs(trainer)[-1]["loss"] > 0


# ------------------------------------------------------------ 15. reproducibility


def test_same_seed_same_weights_different_seed_different_weights(tmp_path):
    data = token_data()

    def run(seed: int, name: str) -> dict[str, torch.Tensor]:
        args = make_args(tmp_path / name, seed=seed, optim="adamw_torch", learning_rate=1e-2, max_steps=3,
                         per_device_train_batch_size=2)  # random sampling order, dropout on
        trainer = Trainer(model_init=lambda: TinyGPT(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16,
                                                     block_size=16, dropout=0.2),
                          args=args, train_dataset=data)
        trainer.train()
        return params(trainer.model)

    first, again, other = run(7, "a"), run(7, "b"), run(8, "c")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


# ------------------------------------------------------------ 16. TrainingArguments


def test_training_arguments_hf_defaults():
    args = TrainingArguments()
    assert args.output_dir == "trainer_output"
    assert args.logging_steps == 500 and args.save_steps == 500
    assert args.optim == "adamw_torch_fused"
    assert args.learning_rate == 5e-5 and args.num_train_epochs == 3.0 and args.max_steps == -1
    assert args.per_device_train_batch_size == 8 and args.seed == 42
    assert args.lr_scheduler_type == "linear" and args.max_grad_norm == 1.0
    assert args.report_to == []
    # "all" means every sink whose package is installed (trackio is a dependency).
    assert TrainingArguments("x", report_to="all").report_to[:2] == ["jsonl", "trackio"]
    assert TrainingArguments("x", report_to=None).report_to == []
    assert TrainingArguments("x", report_to="jsonl").report_to == ["jsonl"]
    assert TrainingArguments("x", report_to=["none"]).report_to == []
    with pytest.raises(ArgumentError, match="report_to"):
        TrainingArguments("x", report_to="wandb_typo")


def test_training_arguments_positional_output_dir_and_derived_values():
    args = TrainingArguments("out", per_device_train_batch_size=6, per_device_eval_batch_size=3)
    assert args.output_dir == "out" and args.run_name is None  # as HF: trackers pick a name, the event log uses output_dir
    if not torch.cuda.is_available():
        assert args.n_gpu == 0
        assert args.device == torch.device("cpu")
    assert args.train_batch_size == 6 * max(1, args.n_gpu)
    assert args.eval_batch_size == 3 * max(1, args.n_gpu)
    assert TrainingArguments("out", use_cpu=True).device == torch.device("cpu")


@pytest.mark.parametrize("kwargs,key,fragment", [
    pytest.param({"tf32": True}, "tf32", "GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="needs a machine without CUDA")),
    ({"warmup_steps": 1.5}, "warmup_steps", "1.5"),
    ({"logging_steps": 0}, "logging_steps", "> 0"),
    ({"dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor", "num_workers"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"},
     "load_best_model_at_end", "match"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 5},
     "load_best_model_at_end", "multiple"),
    ({"push_to_hub": True}, "push_to_hub", "Hub"),
    ({"eval_on_start": True}, "eval_on_start", "eval_strategy"),
    ({"lr_scheduler_type": "cosine_bogus"}, "lr_scheduler_type", "cosine_with_restarts"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size", "positive"),
])
def test_training_arguments_validation(kwargs, key, fragment):
    with pytest.raises(ArgumentError) as info:
        TrainingArguments("out", **kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")
    assert fragment in str(info.value)


def test_training_arguments_valid_combinations():
    args = TrainingArguments("out", load_best_model_at_end=True, eval_strategy="steps", eval_steps=50,
                             save_steps=100)
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert TrainingArguments("out", eval_strategy="steps").eval_steps == 500  # defaults to logging_steps
    assert TrainingArguments("out", warmup_steps=0.1).get_warmup_steps(95) == 10
    assert TrainingArguments("out", warmup_steps=7).get_warmup_steps(95) == 7
    assert TrainingArguments("out", lr_scheduler_kwargs='{"num_cycles": 3}').lr_scheduler_kwargs == {"num_cycles": 3}


@dataclass
class MyArguments(TrainingArguments):
    lora_rank: int = 8


def test_training_arguments_subclass_with_an_extra_field(tmp_path):
    args = MyArguments(str(tmp_path), lora_rank=4, learning_rate=1e-3, optim="sgd", max_steps=1,
                       disable_tqdm=True, save_strategy="no")
    assert args.lora_rank == 4 and args.learning_rate == 1e-3
    assert args.to_dict()["lora_rank"] == 4
    with pytest.raises(ArgumentError):
        MyArguments(str(tmp_path), warmup_steps=1.5)  # the parent's validation still runs
    train, _ = class_data(n=8)
    trainer = Trainer(mlp(), args, train_dataset=train)
    trainer.train()
    assert trainer.state.global_step == 1


def test_training_arguments_to_dict_and_json():
    args = TrainingArguments("out", learning_rate=3e-4, lr_scheduler_kwargs={"num_cycles": 2},
                             include_num_input_tokens_seen=True)
    data = args.to_dict()
    assert data["output_dir"] == "out" and data["learning_rate"] == 3e-4
    assert data["lr_scheduler_kwargs"] == {"num_cycles": 2}
    assert data["include_num_input_tokens_seen"] == "all"
    parsed = json.loads(args.to_json_string())
    assert parsed == json.loads(json.dumps(data, default=str))
    # The JSON round-trips into equal arguments.
    rebuilt = TrainingArguments(**{k: v for k, v in parsed.items()})
    assert rebuilt.to_dict() == data
