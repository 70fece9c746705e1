"""The checkpoint tests' run: TinyGPT with 16-dim embeddings on 48 random token rows, small
batches, a fast learning rate and a fixed seed, so bitwise comparisons take seconds."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

from workbench import Trainer, TrainerCallback
from workbench.checkpoint.store import CheckpointStore
from workbench.data.builtin import TensorDictDataset

from support.runs import StopAt, tiny_gpt
from support.runs import make_args as _make_args

# Small batches, a fast learning rate and a fixed seed for every run here.
make_args = functools.partial(_make_args, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                              learning_rate=1e-2, seed=1)


VOCAB = 40
SEQ = 16
N_TRAIN = 48  # batch 4 -> 12 micro-batches an epoch


def token_rows(n: int, seed: int) -> TensorDictDataset:
    """``n`` random rows of SEQ token ids, each its own labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    return TensorDictDataset(input_ids=ids, labels=ids.clone())


TRAIN = token_rows(N_TRAIN, 0)
EVAL = token_rows(8, 1)


# The model of every run here: tiny_gpt(seed, **overrides) at this vocabulary and length.
gpt = functools.partial(tiny_gpt, vocab_size=VOCAB, block_size=SEQ)


class StopAfterEval(TrainerCallback):
    """Ask for save + stop right after the evaluation at step ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_save = True
            control.should_training_stop = True


def run(out, *, max_steps: int, stop: int | None = None, resume=None, model_seed: int = 0,
        dropout: float = 0.0, callbacks=(), eval_dataset=None, compute_metrics=None, model=None,
        **overrides) -> Trainer:
    """Train :func:`gpt` on TRAIN for ``max_steps`` (stopping and saving at ``stop``), resuming
    from ``resume``; the finished Trainer."""
    model = model if model is not None else gpt(model_seed, dropout=dropout)
    args = make_args(out, max_steps=max_steps, **overrides)
    cbs = list(callbacks) + ([StopAt(stop)] if stop else [])
    trainer = Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=eval_dataset,
                      compute_metrics=compute_metrics, callbacks=cbs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(trainer: Trainer, key: str = "loss") -> list[tuple[int, float]]:
    """(step, value) of every logged ``key``."""
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def assert_same_run(a: Trainer, b: Trainer) -> None:
    """Bitwise: every parameter, every optimizer state tensor, the logged losses."""
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    n_tensors = 0
    for index, entry in sa["state"].items():
        assert entry.keys() == sb["state"][index].keys()
        for key, value in entry.items():
            other = sb["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"optimizer state {index}/{key} differs"
                n_tensors += 1
            else:
                assert value == other
    assert n_tensors > 0
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]
    assert logged(a) == logged(b)
    assert a.state.global_step == b.state.global_step


def checkpoint_names(out) -> list[str]:
    """The checkpoint folders in ``out``, as the store lists them."""
    return [info.name for info in CheckpointStore(out).list()]


def reseal(checkpoint: Path) -> None:
    """Rewrite manifest.json for the files as they are now (a deliberate forgery)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for rel in manifest["files"]:
        data = (checkpoint / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class ScriptedMetric:
    """compute_metrics returning a chosen value per step: {"score": script[global_step]}."""

    def __init__(self, script: dict[int, float], name: str = "score") -> None:
        self.script, self.name = script, name
        self.trainer: Trainer | None = None

    def __call__(self, pred):
        return {self.name: self.script[self.trainer.state.global_step]}


def run_scripted(out, script, *, max_steps, callbacks=(), resume=None, **overrides) -> Trainer:
    """Like :func:`run`, evaluating on EVAL with :class:`ScriptedMetric` ``script``."""
    metric = ScriptedMetric(script)
    args = make_args(out, max_steps=max_steps, **overrides)
    trainer = Trainer(model=gpt(0), args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                      compute_metrics=metric, callbacks=list(callbacks))
    metric.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer
