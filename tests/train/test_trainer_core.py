"""Trainer core: real training runs of tiny models on the CPU.

Covers gradient accumulation exactness, num_items_in_batch, loss scaling under accumulation,
the NaN/inf log filter, token counting and the loss window. The optimizer side (schedules,
weight decay, optimizers, clipping, label smoothing) is in test_trainer_optim.py, the plan
and TrainingArguments in test_trainer_plan.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from workbench import Trainer
from workbench.models import MLPClassifier

from support import make_args
from support.small import (
    SEQ,
    LogitsOnlyLM,
    MeanLossClassifier,
    class_data,
    gpt_token_loss,
    mlp,
    params,
    shifted_targets,
    small_gpt,
    token_data,
    train_logs,
    update_norm,
)

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
        return LogitsOnlyLM() if variant == "logits_only_module" else small_gpt()

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
    Trainer(small_gpt(), args, train_dataset=data, compute_loss_func=loss_func).train()

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
    model = small_gpt()
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
    trainer = Trainer(small_gpt(), args, train_dataset=data)
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


def test_a_restored_loss_window_sums_its_entries_with_the_later_ones_in_one_reduction():
    """A resumed run's first log equals the uninterrupted run's to the last bit: the window a
    checkpoint carried is reduced together with the entries that follow (peek at restore, never
    an early fold, which rounds differently: 10.202921867 against 10.202920914 for these)."""
    from workbench.train.loss_window import LossWindow

    cpu = torch.device("cpu")
    values = (torch.rand(7, generator=torch.Generator().manual_seed(1)) * 3).tolist()
    whole, first = LossWindow(cpu, True), LossWindow(cpu, True)
    for k, value in enumerate(values):
        whole.add(torch.tensor(value), k)
    for k, value in enumerate(values[:2]):
        first.add(torch.tensor(value), k)
    resumed = LossWindow(cpu, True)
    resumed.restore(first.export())
    assert resumed.peek().item() == first.total().item()  # what LossLog.restore reads of it
    for k, value in enumerate(values[2:], 2):
        resumed.add(torch.tensor(value), k)
    assert resumed.total().item() == whole.total().item()
