"""What the GPU checks share (benchmarks/gpu_checks.py): the device a check runs on (set once
per process by ``configure``; read as ``common.DEVICE``), outcomes, and small models."""


from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _timing import Stopwatch
from torch import nn
from torch.utils.data import Dataset

from workbench import Trainer, TrainerCallback, TrainingArguments

DEVICE = "cpu"  # set by configure(): "cuda" or "cpu"
CUDA = False
MIB = 2**20


class Skip(Exception):
    """The check does not apply on this machine (the message says why)."""


@dataclass
class Outcome:
    status: str  # PASS, FAIL or SKIP
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


def verdict(problems: list[str], summary: str, figures: dict[str, Any]) -> Outcome:
    """FAIL naming the problems (then the figures' summary), else PASS."""
    if problems:
        return Outcome("FAIL", "; ".join(problems) + " | " + summary, figures)
    return Outcome("PASS", summary, figures)


def configure(device: str) -> None:
    """Use ``device`` for every run of this process."""
    global DEVICE, CUDA
    DEVICE, CUDA = device, device == "cuda"
    if not CUDA:
        torch.set_num_threads(1)  # these checks are about code paths, not CPU speed; cores are shared


# -- shared pieces -------------------------------------------------------------------------


def train_args(out: str | Path, **overrides: Any) -> TrainingArguments:
    """Quiet arguments for a short run on this process's device."""
    options: dict[str, Any] = {"output_dir": str(out), "report_to": "none", "disable_tqdm": True,
                               "save_strategy": "no", "logging_steps": 10, "seed": 42, "use_cpu": not CUDA}
    options.update(overrides)
    return TrainingArguments(**options)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def host_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def all_finite(weights: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in weights)


class Clock(TrainerCallback):
    """Times the training loop (first hook to last) into a Stopwatch."""

    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch

    def on_train_begin(self, args, state, control, **kwargs):
        sync()
        self.watch.begin()

    def on_train_end(self, args, state, control, **kwargs):
        sync()
        self.watch.end()


@dataclass
class LM:
    """The tiny GPT workload: its data, vocabulary, model size and batch on this device."""

    train: Dataset
    eval: Dataset
    vocab: int
    batch: int

    def model(self) -> nn.Module:
        from workbench.models import TinyGPT

        torch.manual_seed(0)
        if CUDA:  # large enough that the GPU's precision shows in the step time
            return TinyGPT(vocab_size=self.vocab, n_layer=6, n_head=12, n_embd=768, block_size=128)
        return TinyGPT(vocab_size=self.vocab, n_layer=2, n_head=4, n_embd=128, block_size=128)  # the demo's


def lm() -> LM:
    from workbench.data.builtin import builtin_tokenizer, load_builtin_data

    train, eval_ = load_builtin_data("python-source", block_size=128, max_chars=400_000)
    return LM(train, eval_, builtin_tokenizer("python-source").vocab_size, 32 if CUDA else 8)


def losses_of(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


N, DIM, BATCH = 64, 8, 4  # 16 steps of a linear regression, as tests/support/guarded.py


class Poisoned(Dataset):
    """Regression rows with an id; rows in ``nan_ids`` give a NaN loss, rows in ``spike_ids``
    a loss ``spike`` times larger (the pattern of tests/support/guarded.py)."""

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
    """A linear model whose per-sample loss is scaled by ``mult``; ``poison`` makes it NaN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(DIM, 1)
        self.poison = False

    def forward(self, x, labels=None, mult=None, idx=None):
        out = self.lin(x)
        loss = (((out - labels) ** 2).squeeze(-1) * mult).mean()
        return {"loss": loss * float("nan") if self.poison else loss, "logits": out}
