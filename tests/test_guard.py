"""The guard (issue #18): non-finite and spiking losses are skipped on the device, recorded
as ``guard`` events and in checkpoints, and a resumed run repeats them exactly.

The model is a linear regression whose loss is multiplied per sample by ``mult``: chosen
sample ids carry NaN (a non-finite loss) or a large factor (a spike), so which step goes
bad depends only on the (seeded) data order.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from conftest import StopAt, make_args
from workbench import Guard, Trainer, TrainerCallback
from workbench.config.loader import ConfigError, config_from_dict, load_config
from workbench.train.args import ArgumentError
from workbench.train.tracking import read_events

N, DIM, BATCH = 64, 8, 4


class Poisoned(Dataset):
    """Regression rows with an id; rows in ``nan_ids`` give a NaN loss, rows in
    ``spike_ids`` a loss ``spike`` times larger."""

    def __init__(self, nan_ids=(), spike_ids=(), spike: float = 400.0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, DIM, generator=gen)
        self.y = self.x @ torch.randn(DIM, 1, generator=gen)
        self.mult = torch.ones(N)
        self.mult[list(spike_ids)] = spike
        self.mult[list(nan_ids)] = float("nan")

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "mult": self.mult[i], "idx": i}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(DIM, 1)

    def forward(self, x, labels=None, mult=None, idx=None):
        out = self.lin(x)
        per_sample = ((out - labels) ** 2).squeeze(-1) * mult
        return {"loss": per_sample.mean(), "logits": out}


class Order(TrainerCallback):
    """The sample ids of each step, in order (read from the batch the step trains on)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.steps: list[list[int]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(self.trainer.last_inputs["idx"].tolist())


def run(out, data: Poisoned, guard: Guard | None = None, callbacks=(), resume=None, **overrides):
    order = Order()
    options = dict(max_steps=N // BATCH, per_device_train_batch_size=BATCH, learning_rate=0.05,
                   lr_scheduler_type="linear", seed=3)
    options.update(overrides)
    trainer = Trainer(model=Regression(), args=make_args(out, **options), train_dataset=data,
                      callbacks=[order, *callbacks], guard=guard)
    for callback in (order, *callbacks):
        if hasattr(callback, "trainer"):
            callback.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, order


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def step_of(order: Order, sample: int) -> int:
    """The 1-based step that trained on ``sample``."""
    return next(i + 1 for i, ids in enumerate(order.steps) if sample in ids)


# ------------------------------------------------------------------------ configuration


def test_guard_defaults_off_and_validates_each_field():
    assert not Guard().active
    assert Guard(nonfinite="skip").active and Guard(spike="pause").active
    bad = [dict(nonfinite="drop"), dict(spike="stop"), dict(spike_factor=1.0), dict(spike_factor="3"),
           dict(window=0), dict(snapshots=0), dict(rollback_skip=-1), dict(lr_backoff=1.5),
           dict(max_interventions=0), dict(window=True)]
    for kwargs in bad:
        (key,) = kwargs
        with pytest.raises(ArgumentError) as info:
            Guard(**kwargs)
        assert info.value.key == key


def _config(tmp_path, guard_table: str):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nbuiltin = "mlp"\n[data]\nbuiltin = "random-classification"\n'
                    f"[training]\noutput_dir = \"out\"\n[guard]\n{guard_table}", encoding="utf-8")
    return path


def test_guard_table_in_config(tmp_path):
    run = load_config(_config(tmp_path, 'nonfinite = "skip"\nspike = "pause"\nspike_factor = 5.0\nwindow = 20\n'))
    assert run.guard == Guard(nonfinite="skip", spike="pause", spike_factor=5.0, window=20)
    assert run.raw["guard"]["window"] == 20  # recorded in output_dir/config.toml
    no_table = config_from_dict({"model": {"builtin": "mlp"}, "data": {"builtin": "random-classification"}}, base_dir=tmp_path)
    assert no_table.guard is None


@pytest.mark.parametrize("table, line, message", [
    ('nonfinite = "skip"\nspike = "explode"\n', 9, "guard.spike: expected one of off, skip, rollback, pause"),
    ('window = 0\n', 8, "guard.window: expected an integer >= 1"),
    ('windw = 5\n', 8, "guard.windw: unknown key (did you mean window?)"),
    ('spike_factor = "3"\n', 8, "guard.spike_factor: expected"),
])
def test_bad_guard_values_are_one_located_line(tmp_path, table, line, message):
    path = _config(tmp_path, table)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}: {message}"), text
    assert "\n" not in text


# ------------------------------------------------------------------------------- skip


NAN_SAMPLE = 37


def test_off_lets_nan_through_as_hf(tmp_path):
    trainer, order = run(tmp_path, Poisoned(nan_ids=[NAN_SAMPLE]))
    assert any(NAN_SAMPLE in ids for ids in order.steps)
    assert all(torch.isnan(w).all() for w in weights(trainer))


class MaskStep(TrainerCallback):
    """Masks one step's update by hand: parameters and optimizer state saved right before
    the optimizer step and put back right after it."""

    def __init__(self, step: int) -> None:
        self.step, self.trainer, self.saved = step, None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            opt = self.trainer.optimizer
            self.saved = (weights(self.trainer), copy.deepcopy(opt.state_dict()))

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            params, opt_state = self.saved
            with torch.no_grad():
                for p, old in zip(self.trainer.model.parameters(), params):
                    p.copy_(old)
            self.trainer.optimizer.load_state_dict(opt_state)


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd"])
def test_skip_equals_a_hand_masked_step(tmp_path, optim):
    data = Poisoned(nan_ids=[NAN_SAMPLE])
    guarded, order = run(tmp_path / "g", data, Guard(nonfinite="skip"), optim=optim)
    bad_step = step_of(order, NAN_SAMPLE)
    assert all(torch.isfinite(w).all() for w in weights(guarded))
    assert guarded.state.global_step == N // BATCH  # the step counter still advanced

    # The same run without the guard, that step's update undone by hand, the NaN sample's
    # loss made finite first so only the masked step differs.
    mask = MaskStep(bad_step)
    clean = Poisoned(nan_ids=[NAN_SAMPLE])
    clean.mult[NAN_SAMPLE] = 1.0
    by_hand, hand_order = run(tmp_path / "h", clean, callbacks=[mask], optim=optim)
    assert hand_order.steps == order.steps
    for a, b in zip(weights(guarded), weights(by_hand)):
        assert torch.equal(a, b)
