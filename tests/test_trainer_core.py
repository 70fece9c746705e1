"""Trainer core: real training runs of tiny models on the CPU.

Covers gradient accumulation exactness, num_items_in_batch, loss scaling, LR schedules,
weight-decay groups, optimizers, clipping, label smoothing, the NaN/inf log filter, token
counting, auto_find_batch_size, activation checkpointing, step/epoch planning, clear errors,
seeding and TrainingArguments (defaults, validation, derived values, subclassing).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from workbench import Trainer, TrainerCallback, TrainingArguments
from workbench.core.args.training import ArgumentError
from workbench.data.builtin import TensorDictDataset, load_builtin_data
from workbench.models import MLPClassifier, TinyGPT
from conftest import StopAt, make_args

VOCAB = 40
SEQ = 10



# ----------------------------------------------------------------------------- helpers


def tiny_gpt(seed: int = 0, **overrides) -> TinyGPT:
    torch.manual_seed(seed)
    options = {"vocab_size": VOCAB, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
    options.update(overrides)
    return TinyGPT(**options)


def mlp(seed: int = 0, cls: type[MLPClassifier] = MLPClassifier, **overrides) -> MLPClassifier:
    torch.manual_seed(seed)
    options = {"in_features": 8, "hidden": 16, "num_classes": 4}
    options.update(overrides)
    return cls(**options)


def token_data(n: int = 8) -> TensorDictDataset:
    """Right-padded token rows with a different number of real tokens per row."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=gen)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    for i in range(n):
        pad = (i * 3) % (SEQ - 2)  # 0, 3, 6, 1, 4, 7, 2, 5, ...
        if pad:
            mask[i, SEQ - pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return TensorDictDataset(input_ids=ids, attention_mask=mask, labels=labels)


def class_data(n: int = 32, n_eval: int = 16) -> tuple[TensorDictDataset, TensorDictDataset]:
    return load_builtin_data("random-classification", n_train=n, n_eval=n_eval, in_features=8, num_classes=4)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def update_norm(before: dict[str, torch.Tensor], model: nn.Module) -> float:
    diffs = [(p.detach() - before[name]).flatten() for name, p in model.named_parameters()]
    return torch.cat(diffs).norm().item()


def train_logs(trainer: Trainer) -> list[dict]:
    """The per-step log entries (not the final train_runtime summary, not evaluations)."""
    return [e for e in trainer.state.log_history if "loss" in e]


def shifted_targets(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def gpt_token_loss(outputs, labels, num_items_in_batch=None):
    """A user compute_loss_func: next-token cross entropy summed, over the step's target count."""
    logits = outputs["logits"][:, :-1]
    targets = labels[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                            ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


class LogitsOnlyLM(nn.Module):
    """A plain module with no labels argument: the Trainer picks the loss from loss_type."""

    loss_type = "ForCausalLM"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.inner = tiny_gpt(seed)

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids, attention_mask=attention_mask)["logits"]


class MeanLossClassifier(nn.Module):
    """Returns its own mean loss and takes no loss kwargs (no num_items_in_batch, no **kwargs)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.inner = mlp(seed)

    def forward(self, x, labels=None):
        logits = self.inner(x)["logits"]
        out = {"logits": logits}
        if labels is not None:
            out = {"loss": F.cross_entropy(logits, labels), **out}
        return out


# ------------------------------------------------------------ 1. gradient accumulation


def _one_sgd_step(tmp_path, model, accumulation: int, batch: int, **trainer_kwargs) -> Trainer:
    args = make_args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                     max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
                     lr_scheduler_type="constant", train_sampling_strategy="sequential")
    trainer = Trainer(model, args, train_dataset=token_data(), **trainer_kwargs)
    trainer.train()
    return trainer


@pytest.mark.parametrize("variant", ["model_loss", "compute_loss_func", "logits_only_module"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, variant):
    data = token_data()
    per_micro = [shifted_targets(data.tensors["labels"][i:i + 2]) for i in range(0, 8, 2)]
    assert len(set(per_micro)) > 1, "the micro-batches must hold different numbers of targets"

    def build():
        return LogitsOnlyLM() if variant == "logits_only_module" else tiny_gpt()

    kwargs = {"compute_loss_func": gpt_token_loss} if variant == "compute_loss_func" else {}
    initial = params(build())
    accumulated = build()
    big = build()
    t_acc = _one_sgd_step(tmp_path / "acc", accumulated, accumulation=4, batch=2, **kwargs)
    t_big = _one_sgd_step(tmp_path / "big", big, accumulation=1, batch=8, **kwargs)

    assert t_acc.state.global_step == t_big.state.global_step == 1
    assert update_norm(initial, accumulated) > 1e-3  # the step really moved the weights
    for (name, a), (_, b) in zip(accumulated.named_parameters(), big.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name
    # The logged loss of the accumulated step is the loss of the whole batch.
    assert train_logs(t_acc)[0]["loss"] == pytest.approx(train_logs(t_big)[0]["loss"], rel=1e-5)


# ------------------------------------------------------------ 2. num_items_in_batch


def _recording(inner):
    seen: list[int] = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(int(num_items_in_batch))
        return inner(outputs, labels, num_items_in_batch)

    return loss_func, seen


def test_num_items_in_batch_counts_shifted_targets_of_the_whole_step(tmp_path):
    data = token_data()
    loss_func, seen = _recording(gpt_token_loss)
    args = make_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                     optim="sgd", train_sampling_strategy="sequential")
    Trainer(tiny_gpt(), args, train_dataset=data, compute_loss_func=loss_func).train()

    labels = data.tensors["labels"]
    step1, step2 = shifted_targets(labels[:4]), shifted_targets(labels[4:])
    assert step1 != step2
    assert seen == [step1, step1, step2, step2]


def test_num_items_in_batch_counts_labels_for_classification(tmp_path):
    train, _ = class_data(n=20)

    def ce(outputs, labels, num_items_in_batch=None):
        return F.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    loss_func, seen = _recording(ce)
    # 20 rows in micro-batches of 4 -> 5 micro-batches: a step of 3 and a last step of 2.
    args = make_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_train_epochs=1,
                     optim="sgd")
    trainer = Trainer(mlp(), args, train_dataset=train, compute_loss_func=loss_func)
    trainer.train()
    assert trainer.state.global_step == 2
    assert seen == [12, 12, 12, 8, 8]


# ------------------------------------------------------------ 3. loss scaling under accumulation


def test_compute_loss_func_result_is_not_divided_again(tmp_path):
    data = token_data()
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    args = make_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1,
                     optim="sgd", learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant",
                     train_sampling_strategy="sequential")
    trainer = Trainer(model, args, train_dataset=data, compute_loss_func=gpt_token_loss)
    trainer.train()

    rows = data.tensors
    out = reference(rows["input_ids"], attention_mask=rows["attention_mask"])
    full = gpt_token_loss(out, rows["labels"], num_items_in_batch=shifted_targets(rows["labels"]))
    full.backward()
    # Logged loss = the loss over all 8 rows (a second division by 4 would log a quarter of it).
    assert train_logs(trainer)[0]["loss"] == pytest.approx(full.item(), rel=1e-5)
    # And the update is lr * that loss's gradient.
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q.detach() - 0.5 * q.grad, atol=1e-6, rtol=0), name


def test_model_without_loss_kwargs_gets_loss_divided_by_accumulation_steps(tmp_path):
    train, _ = class_data(n=16)

    def run(accumulation: int, batch: int, name: str):
        model = MeanLossClassifier()
        args = make_args(tmp_path / name, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=0.5,
                         max_grad_norm=0.0, lr_scheduler_type="constant", train_sampling_strategy="sequential")
        trainer = Trainer(model, args, train_dataset=train)
        trainer.train()
        return model, trainer

    assert not Trainer(MeanLossClassifier(), make_args(tmp_path / "probe")).model_accepts_loss_kwargs
    initial = params(MeanLossClassifier())
    accumulated, t_acc = run(4, 4, "acc")
    big, t_big = run(1, 16, "big")
    # Equal-size micro-batches: the mean of 4 means divided by 4 is the mean of the big batch.
    assert update_norm(initial, accumulated) > 1e-3
    for (name, a), b in zip(accumulated.named_parameters(), big.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name
    x, y = train.tensors["x"], train.tensors["labels"]
    expected = F.cross_entropy(MeanLossClassifier()(x)["logits"], y).item()
    assert train_logs(t_acc)[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert train_logs(t_big)[0]["loss"] == pytest.approx(expected, rel=1e-5)


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
    model = tiny_gpt()
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
    model = tiny_gpt()
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
    model = tiny_gpt()
    rows = data.tensors
    with torch.no_grad():
        logits = model(rows["input_ids"], attention_mask=rows["attention_mask"])["logits"]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), rows["labels"][:, 1:].reshape(-1),
                               ignore_index=-100, label_smoothing=0.1).item()
    args = make_args(tmp_path, label_smoothing_factor=0.1, optim="sgd", max_steps=1, per_device_train_batch_size=4)
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    assert train_logs(trainer)[0]["loss"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------ 9. NaN / inf filter


class NaNOnceClassifier(MLPClassifier):
    """Its loss is NaN on one forward call; gradients stay finite (NaN is added as a constant)."""

    bad_call = 3

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        out = super().forward(x, labels, num_items_in_batch)
        self.calls += 1
        if labels is not None and self.calls == self.bad_call:
            out["loss"] = out["loss"] + float("nan")
        return out


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logging_nan_inf_filter(tmp_path, nan_filter):
    train, _ = class_data(n=16)
    model = mlp(cls=NaNOnceClassifier)
    args = make_args(tmp_path, logging_nan_inf_filter=nan_filter, optim="sgd", max_steps=4,
                     per_device_train_batch_size=4, logging_steps=4)
    trainer = Trainer(model, args, train_dataset=train)
    output = trainer.train()
    assert model.calls == 4
    (log,) = train_logs(trainer)
    if nan_filter:
        assert math.isfinite(log["loss"]) and log["loss"] > 0
        assert math.isfinite(output.training_loss)
    else:
        assert math.isnan(log["loss"])
        assert math.isnan(output.training_loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------ 10. input tokens seen


@pytest.mark.parametrize("setting,normalized", [("all", "all"), (True, "all"), ("non_padding", "non_padding"),
                                                (False, "no"), ("no", "no")])
def test_include_num_input_tokens_seen(tmp_path, setting, normalized):
    data = token_data()
    args = make_args(tmp_path, include_num_input_tokens_seen=setting, optim="sgd", max_steps=2,
                     per_device_train_batch_size=4, train_sampling_strategy="sequential")
    assert args.include_num_input_tokens_seen == normalized
    trainer = Trainer(tiny_gpt(), args, train_dataset=data)
    trainer.train()
    mask = data.tensors["attention_mask"]
    logs = train_logs(trainer)
    if normalized == "no":
        assert trainer.state.num_input_tokens_seen == 0
        assert all("num_input_tokens_seen" not in e for e in trainer.state.log_history)
        return
    if normalized == "all":
        expected = [4 * SEQ, 8 * SEQ]
    else:
        expected = [int(mask[:4].sum()), int(mask.sum())]
        assert expected[1] < 8 * SEQ
    assert [e["num_input_tokens_seen"] for e in logs] == expected
    assert trainer.state.num_input_tokens_seen == expected[1]


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
        model = tiny_gpt()
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


@pytest.mark.slow
def test_torch_compile_trains_the_compiled_model_and_saves_plain_weights(tmp_path):
    # Compiling on the CPU builds C++ kernels with the system compiler: about a minute here.
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    train, evals = load_builtin_data("random-classification", n_train=256)
    torch.manual_seed(0)
    args = TrainingArguments(str(tmp_path), max_steps=10, torch_compile=True, disable_tqdm=True,
                             save_strategy="steps", save_steps=10, logging_steps=5, report_to="none")
    trainer = Trainer(MLPClassifier(), args=args, train_dataset=train, eval_dataset=evals)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert trainer.evaluate()["eval_loss"] < before
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-10" / "model.safetensors"))
    assert not any(k.startswith("_orig_mod") for k in saved)  # the user's module, not the wrapper


# ------------------------------------------------------------ the loss window (logging_nan_inf_filter)


@pytest.mark.parametrize("n,fold", [(7, 1024), (50, 8)])
def test_loss_window_matches_hf_sequential_nan_rule(monkeypatch, n, fold):
    """The vectorized window equals HF's step-by-step rule: a non-finite loss adds
    running_sum / (1 + steps so far in the window) instead of itself."""
    from workbench.train import loss_window

    monkeypatch.setattr(loss_window, "FOLD", fold)
    gen = torch.Generator().manual_seed(n)
    values = torch.rand(n, generator=gen, dtype=torch.float64) * 3
    values[[1, 4, n - 1]] = float("nan")
    values[2] = float("inf")
    steps_before = [i // 2 for i in range(n)]  # two micro-batches per optimizer step
    for use_filter in (True, False):
        window = loss_window.LossWindow(torch.device("cpu"), use_filter)
        expected = 0.0
        for value, k in zip(values.tolist(), steps_before):
            window.add(torch.tensor(value, dtype=torch.float32), k)
            if use_filter and not math.isfinite(value):
                expected += expected / (1 + k)
            else:
                expected += value
        total = window.total().item()
        if use_filter:
            assert total == pytest.approx(expected, rel=1e-5)
        else:
            assert math.isnan(total)
        window.reset()
        assert window.total().item() == 0.0 and not window
