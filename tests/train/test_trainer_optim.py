"""The optimizer side of a step: LR schedules against their formulas, weight-decay groups,
the optimizers by name, gradient clipping and label smoothing, each on real tiny runs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench import Trainer, TrainerCallback, TrainingArguments
from workbench.core.args.training import ArgumentError
from workbench.data.builtin import TensorDictDataset

from support import make_args
from support.small import VOCAB, class_data, mlp, params, small_gpt, token_data, train_logs, update_norm

# ------------------------------------------------------------ 4. LR schedules


class LRRecorder(TrainerCallback):
    """Records the learning rate each optimizer step uses (read before the step)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.lrs: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.lrs.append(self.trainer.get_learning_rates()[0])


def _warm(step: int, warmup: int) -> float | None:
    return step / warmup if step < warmup else None


def expected_multiplier(kind: str, step: int, warmup: int, total: int, **kw) -> float:
    w = _warm(step, warmup)
    if kind == "constant":
        return 1.0
    if w is not None:
        return w
    if kind == "constant_with_warmup":
        return 1.0
    progress = (step - warmup) / (total - warmup)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "cosine_with_restarts":
        if progress >= 1.0:
            return 0.0  # HF: the schedule ends at 0, not at the top of a new cycle
        return 0.5 * (1.0 + math.cos(math.pi * ((kw["num_cycles"] * progress) % 1.0)))
    if kind == "polynomial":
        lr_init, lr_end, power = 1.0, kw["lr_end"], kw["power"]
        return ((lr_init - lr_end) * (1.0 - progress) ** power + lr_end) / lr_init
    raise AssertionError(kind)


SCHEDULE_CASES = [
    ("linear", {}, 3, 3),
    ("linear", {}, 0.2, 2),  # ratio: ceil(10 * 0.2) = 2 warmup steps
    ("cosine", {}, 2, 2),
    ("cosine", {}, 0.25, 3),  # ceil(2.5) = 3
    ("cosine_with_restarts", {"num_cycles": 2}, 2, 2),
    ("polynomial", {"power": 2.0, "lr_end": 0.1}, 2, 2),
    ("constant", {}, 0, 0),
    ("constant_with_warmup", {}, 4, 4),
    ("constant_with_warmup", {}, 0.3, 3),
]


@pytest.mark.parametrize("kind,kwargs,warmup_arg,warmup", SCHEDULE_CASES)
def test_lr_schedule_shapes(tmp_path, kind, kwargs, warmup_arg, warmup):
    train, _ = class_data(n=40)
    recorder = LRRecorder()
    args = make_args(tmp_path, per_device_train_batch_size=4, num_train_epochs=1, optim="sgd", learning_rate=1.0,
                     lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_steps=warmup_arg)
    trainer = Trainer(mlp(), args, train_dataset=train, callbacks=[recorder])
    recorder.trainer = trainer
    trainer.train()

    total = 10
    assert trainer.state.max_steps == total and args.get_warmup_steps(total) == warmup
    expected = [expected_multiplier(kind, s, warmup, total, **kwargs) for s in range(total)]
    assert recorder.lrs == pytest.approx(expected, abs=1e-9)
    # The logged learning rate of a step is the rate that step used: HF 5.x reads it after the
    # optimizer step, before the schedule's (tests/test_hf_trainer_api.py compares with HF).
    logged = [e["learning_rate"] for e in train_logs(trainer)]
    assert logged == pytest.approx(expected, abs=1e-9)


def test_lr_schedule_anchor_values(tmp_path):
    """A few hand-computed points, independent of the closed forms above."""
    train, _ = class_data(n=40)
    cases = {
        ("linear", 3): {0: 0.0, 1: 1 / 3, 3: 1.0, 5: 5 / 7, 9: 1 / 7},
        ("cosine", 0): {0: 1.0, 5: 0.5, 9: 0.5 * (1 + math.cos(math.pi * 0.9))},
        ("cosine_with_restarts", 0): {0: 1.0, 5: 1.0, 4: 0.5 * (1 + math.cos(math.pi * 0.8))},
        ("polynomial", 0): {0: 1.0, 5: 0.9 * 0.25 + 0.1},
    }
    extra = {"cosine_with_restarts": {"num_cycles": 2}, "polynomial": {"power": 2.0, "lr_end": 0.1}}
    for (kind, warmup), points in cases.items():
        recorder = LRRecorder()
        args = make_args(tmp_path / kind, per_device_train_batch_size=4, num_train_epochs=1, optim="sgd",
                         learning_rate=1.0, lr_scheduler_type=kind, lr_scheduler_kwargs=extra.get(kind),
                         warmup_steps=warmup)
        trainer = Trainer(mlp(), args, train_dataset=train, callbacks=[recorder])
        recorder.trainer = trainer
        trainer.train()
        for step, value in points.items():
            assert recorder.lrs[step] == pytest.approx(value, abs=1e-9), (kind, step)


def test_lr_schedule_is_rebuilt_for_a_second_train_call(tmp_path):
    train, _ = class_data(n=16)
    args = make_args(tmp_path, per_device_train_batch_size=4, num_train_epochs=1, optim="sgd", learning_rate=1.0)
    trainer = Trainer(mlp(), args, train_dataset=train)
    trainer.train()
    first = [e["learning_rate"] for e in train_logs(trainer)]
    trainer.train()
    second = [e["learning_rate"] for e in train_logs(trainer)]
    assert first == second == pytest.approx([1.0, 0.75, 0.5, 0.25])  # each step's own rate, as HF logs it


# ------------------------------------------------------------ 5. weight decay groups


def test_weight_decay_groups(tmp_path):
    model = small_gpt()
    trainer = Trainer(model, make_args(tmp_path, weight_decay=0.1, optim="adamw_torch"))
    decay = set(trainer.get_decay_parameter_names(model))
    names = dict(model.named_parameters())
    assert {"wte.weight", "wpe.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
            "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight"} == decay
    no_decay = set(names) - decay
    assert {n for n in names if n.endswith(".bias")} <= no_decay
    assert {"blocks.0.ln_1.weight", "blocks.0.ln_2.weight", "ln_f.weight"} <= no_decay

    optimizer = trainer.create_optimizer()
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert set(by_decay) == {0.1, 0.0}
    assert by_decay[0.1] == {id(names[n]) for n in decay}
    assert by_decay[0.0] == {id(names[n]) for n in no_decay}


def test_weight_decay_is_applied_to_decay_group_only(tmp_path):
    model = small_gpt()
    before = params(model)

    def zero_loss(outputs, labels, num_items_in_batch=None):
        return outputs["logits"].sum() * 0.0  # every gradient is exactly zero

    args = make_args(tmp_path, optim="adamw_torch", learning_rate=0.1, weight_decay=0.5, max_steps=1,
                     lr_scheduler_type="constant", per_device_train_batch_size=4)
    Trainer(model, args, train_dataset=token_data(), compute_loss_func=zero_loss).train()
    after = dict(model.named_parameters())
    # AdamW's decoupled decay: w <- w * (1 - lr * wd); the Adam part is 0 for zero gradients.
    assert torch.allclose(after["wte.weight"], before["wte.weight"] * (1 - 0.1 * 0.5), atol=1e-7)
    assert torch.allclose(after["blocks.0.attn.qkv.weight"], before["blocks.0.attn.qkv.weight"] * 0.95, atol=1e-7)
    assert not torch.equal(after["wte.weight"], before["wte.weight"])
    assert torch.equal(after["blocks.0.attn.qkv.bias"], before["blocks.0.attn.qkv.bias"])
    assert torch.equal(after["ln_f.weight"], before["ln_f.weight"])


# ------------------------------------------------------------ 6. optimizers


def dataset_loss(model: nn.Module, data: TensorDictDataset) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(data.tensors["x"])["logits"], data.tensors["labels"]).item()


@pytest.mark.parametrize("optim,lr,cls_name", [
    ("adamw_torch", 1e-2, "AdamW"),
    ("adamw_torch_fused", 1e-2, "AdamW"),
    ("sgd", 0.2, "SGD"),
    ("adafactor", 5e-2, "Adafactor"),
])
def test_each_optimizer_trains(tmp_path, optim, lr, cls_name):
    train, _ = class_data(n=128)
    model = mlp()
    start = dataset_loss(model, train)
    args = make_args(tmp_path, optim=optim, learning_rate=lr, per_device_train_batch_size=16, num_train_epochs=3,
                     logging_steps=100)
    trainer = Trainer(model, args, train_dataset=train)
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert type(optimizer).__name__ == cls_name
    if optim == "adamw_torch_fused":
        assert optimizer.param_groups[0]["fused"] is True
    assert dataset_loss(model, train) < 0.85 * start


def test_unknown_optimizer_lists_supported_names():
    with pytest.raises(ArgumentError) as info:
        TrainingArguments("out", optim="adamw_bogus")
    assert info.value.key == "optim"
    for name in ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor"):
        assert name in str(info.value)


def test_optim_args_reach_the_optimizer(tmp_path):
    train, _ = class_data(n=16)
    args = make_args(tmp_path, optim="sgd", optim_args="momentum=0.9, nesterov=true", learning_rate=0.1,
                     max_steps=2, per_device_train_batch_size=8)
    trainer = Trainer(mlp(), args, train_dataset=train)
    trainer.train()
    for group in trainer.optimizer.param_groups:
        assert group["momentum"] == 0.9 and group["nesterov"] is True
    state = next(iter(getattr(trainer.optimizer, "optimizer", trainer.optimizer).state.values()))
    assert "momentum_buffer" in state  # momentum was really used in the steps


# ------------------------------------------------------------ 7. gradient clipping


def _grad_norm_of_first_batch(model: nn.Module, data: TensorDictDataset, batch: int) -> float:
    reference = copy.deepcopy(model)
    out = reference(data.tensors["x"][:batch], labels=data.tensors["labels"][:batch])
    out["loss"].backward()
    return torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.0])
def test_max_grad_norm(tmp_path, max_grad_norm):
    train, _ = class_data(n=8)
    model = mlp()
    true_norm = _grad_norm_of_first_batch(model, train, 8)
    before = params(model)
    args = make_args(tmp_path, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_steps=1,
                     per_device_train_batch_size=8, max_grad_norm=max_grad_norm)
    trainer = Trainer(model, args, train_dataset=train)
    trainer.train()
    log = train_logs(trainer)[0]
    moved = update_norm(before, model)
    assert true_norm > 0.1
    if max_grad_norm:
        assert log["grad_norm"] == pytest.approx(true_norm, rel=1e-5)  # the norm before clipping
        assert moved <= 1.0 * max_grad_norm * (1 + 1e-4)
        assert moved == pytest.approx(max_grad_norm, rel=1e-3)
    else:
        assert all("grad_norm" not in e for e in trainer.state.log_history)
        assert moved == pytest.approx(true_norm, rel=1e-4)  # lr 1.0, unclipped


# ------------------------------------------------------------ 8. label smoothing


def test_label_smoothing_matches_torch_cross_entropy_for_a_classifier(tmp_path):
    train, evals = class_data(n=8, n_eval=12)
    model = mlp()
    with torch.no_grad():
        model.head.weight.mul_(20)  # confident logits, where smoothing changes the loss a lot
    x, y = train.tensors["x"], train.tensors["labels"]
    with torch.no_grad():
        logits = model(x)["logits"]
    smoothed = F.cross_entropy(logits, y, label_smoothing=0.2).item()
    plain = F.cross_entropy(logits, y).item()
    assert abs(smoothed - plain) > 1e-2

    args = make_args(tmp_path, label_smoothing_factor=0.2, optim="sgd", max_steps=1, per_device_train_batch_size=8,
                     per_device_eval_batch_size=12)
    trainer = Trainer(model, args, train_dataset=train)
    trainer.train()
    assert train_logs(trainer)[0]["loss"] == pytest.approx(smoothed, rel=1e-5)

    metrics = trainer.evaluate(evals)
    with torch.no_grad():
        expected_eval = F.cross_entropy(model(evals.tensors["x"])["logits"], evals.tensors["labels"],
                                        label_smoothing=0.2).item()
    assert metrics["eval_loss"] == pytest.approx(expected_eval, rel=1e-5)


def test_label_smoothing_for_a_causal_lm_shifts_labels(tmp_path):
    data = token_data(4)
    model = small_gpt()
    rows = data.tensors
    with torch.no_grad():
        logits = model(rows["input_ids"], attention_mask=rows["attention_mask"])["logits"]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), rows["labels"][:, 1:].reshape(-1),
                               ignore_index=-100, label_smoothing=0.1).item()
    args = make_args(tmp_path, label_smoothing_factor=0.1, optim="sgd", max_steps=1, per_device_train_batch_size=4)
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    assert train_logs(trainer)[0]["loss"] == pytest.approx(expected, rel=1e-5)
