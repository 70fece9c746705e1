"""The evaluation tests' language model: its predictions mean something without training.

The head is the (unit-norm) embedding matrix scaled up, so the argmax at position t is the
input token at t. Sequences that repeat their previous token are therefore predicted right,
random continuations wrong, which gives next-token accuracies strictly between 0 and 1 and
losses that differ between easy and hard rows.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workbench import EvalPrediction, Trainer

from support.runs import make_args as _make_args

SEQ = 16

# Batches of 8 and (almost) no training logs: these runs are about evaluation.
make_args = functools.partial(_make_args, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                              logging_steps=500)


def _unit_rows(vocab: int, dim: int, seed: int) -> torch.Tensor:
    w = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed))
    return w / w.norm(dim=-1, keepdim=True)


class TinyLM(nn.Module):
    """Embedding (vocab x dim) -> linear (dim -> vocab); causal-LM loss when labels given."""

    loss_type = "ForCausalLM"

    def __init__(self, vocab: int = 64, dim: int = 16, scale: float = 10.0, seed: int = 0,
                 extra_output: bool = False) -> None:
        super().__init__()
        rows = _unit_rows(vocab, dim, seed)
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        with torch.no_grad():
            self.embed.weight.copy_(rows)
            self.head.weight.copy_(rows * scale)
            self.head.bias.zero_()
        self.extra_output = extra_output

    def forward(self, input_ids, labels=None, attention_mask=None):
        hidden = self.embed(input_ids)
        logits = self.head(hidden)
        out = {}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab).float(),
                                          labels[:, 1:].reshape(-1), ignore_index=-100)
        out["logits"] = logits
        if self.extra_output:
            out["hidden"] = hidden
        return out


class TargetsLM(TinyLM):
    """Same model, but its label argument is called ``targets``."""

    def forward(self, input_ids, targets=None):
        return super().forward(input_ids, labels=targets)


def lm_rows(n: int, vocab: int = 64, seq: int = SEQ, seed: int = 0, repeat: float = 0.5,
            labels: bool = True, label_key: str = "labels") -> list[dict[str, torch.Tensor]]:
    """Rows whose next token repeats the current one with probability ``repeat``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        keep = torch.rand(seq, generator=g) < repeat
        for t in range(1, seq):
            if keep[t]:
                ids[t] = ids[t - 1]
        row = {"input_ids": ids}
        if labels:
            row[label_key] = ids.clone()
        rows.append(row)
    return rows


def token_accuracy(pred: EvalPrediction) -> dict[str, float]:
    """Next-token accuracy from logits or from ids (prediction at t vs label at t + 1)."""
    preds, labels = np.asarray(pred.predictions), np.asarray(pred.label_ids)
    if preds.ndim == labels.ndim + 1:
        preds = preds.argmax(-1)
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def argmax(logits, labels):
    """A preprocess_logits_for_metrics keeping the predicted ids only."""
    return logits.argmax(dim=-1)


def batch_bytes(batch: int, seq: int, vocab: int | None) -> int:
    """Bytes of one batch's float32 logits (vocab given) or int64 ids/labels."""
    return batch * seq * vocab * 4 if vocab else batch * seq * 8


def eval_logs(trainer: Trainer, key: str = "eval_loss") -> list[dict]:
    """The log entries of the evaluations (those with ``key``)."""
    return [entry for entry in trainer.state.log_history if key in entry]
