"""Small models and data for the Trainer's own tests: a TinyGPT and an MLP whose weights
depend only on a seed, padded token rows, random classes, and the models users write that
return only logits or only a mean loss."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workbench import Trainer
from workbench.data.builtin import TensorDictDataset, load_builtin_data
from workbench.models import MLPClassifier

from support.runs import tiny_gpt

VOCAB = 40
SEQ = 10


# tiny_gpt(seed, **overrides) over VOCAB, 16 positions.
small_gpt = functools.partial(tiny_gpt, vocab_size=VOCAB, block_size=16)


def mlp(seed: int = 0, cls: type[MLPClassifier] = MLPClassifier, **overrides) -> MLPClassifier:
    """An MLP classifier (8 features, 16 hidden, 4 classes unless ``overrides`` say otherwise)."""
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
    """(train, eval) rows of the built-in random classification data for :func:`mlp`."""
    return load_builtin_data("random-classification", n_train=n, n_eval=n_eval, in_features=8, num_classes=4)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's parameters, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def update_norm(before: dict[str, torch.Tensor], model: nn.Module) -> float:
    """The norm of the change from ``before`` (a :func:`params` copy) to the model now."""
    diffs = [(p.detach() - before[name]).flatten() for name, p in model.named_parameters()]
    return torch.cat(diffs).norm().item()


def train_logs(trainer: Trainer) -> list[dict]:
    """The per-step log entries (not the final train_runtime summary, not evaluations)."""
    return [e for e in trainer.state.log_history if "loss" in e]


def shifted_targets(labels: torch.Tensor) -> int:
    """How many next-token targets ``labels`` has (the first position predicts nothing)."""
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
        self.inner = small_gpt(seed)

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
