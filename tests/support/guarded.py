"""The guard's test run: a linear regression whose per-sample loss is multiplied by a
``mult`` column, so chosen sample ids carry NaN (a non-finite loss) or a large factor (a
spike) and which step goes bad depends only on the seeded data order."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from workbench import Guard, Trainer, TrainerCallback

from support.runs import make_args

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


def clean_order(tmp_path) -> list[list[int]]:
    """The data order of these runs (it depends on the seed only, not on the model)."""
    return run(tmp_path / "order", Poisoned())[1].steps
