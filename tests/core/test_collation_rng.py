"""Batches collated ahead of training keep their random draws across a resume (train/rng.py,
``CollationRng``).

Accelerate's loaders collate one batch ahead of the one they hand out, and a step stopped at
its start has collated its micro-batches: a collator that draws from the global streams (Python,
NumPy, torch) made those draws before the checkpoint's RNG state was taken. These tests use a
collator of the user's own that draws from all three, so a resumed run is only bitwise equal to
the uninterrupted one if each stream is replayed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workbench import Trainer, TrainerCallback
from workbench.core.rng import CollationRng, draws_random
from workbench.data.builtin import TensorDictDataset
from workbench.data.collators import DataCollatorWithPadding, default_data_collator
from workbench.models import TinyGPT

from support import StopAt, assert_same_weights, make_args, weights

VOCAB, SEQ = 40, 12
_ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(0))
TRAIN = TensorDictDataset(input_ids=_ids, labels=_ids.clone())


def noisy_collator(rows):
    """Replace a random share of tokens, the share and the positions drawn from all three streams."""
    ids = torch.stack([r["input_ids"] for r in rows])
    share = 0.1 + 0.2 * random.random() + 0.1 * float(np.random.rand())
    mask = torch.rand(ids.shape) < share
    ids = torch.where(mask, torch.randint(0, VOCAB, ids.shape), ids)
    return {"input_ids": ids, "labels": torch.stack([r["labels"] for r in rows])}


class StopBeforeStep(TrainerCallback):
    """Stop with a checkpoint as step ``n`` + 1 begins (its micro-batches fetched, not trained)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_save = control.should_training_stop = True


def train(out, callbacks=(), resume=None, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16, block_size=SEQ, dropout=0.1)
    args = make_args(out, max_steps=9, per_device_train_batch_size=4, learning_rate=1e-2, seed=3,
                     save_strategy="steps", save_steps=100, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=TRAIN, data_collator=noisy_collator,
                      callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("stop", ["step-end", "step-start"])
def test_a_resume_redraws_batches_collated_ahead_from_their_own_streams(tmp_path, stop, accumulation):
    full = train(tmp_path / "full", gradient_accumulation_steps=accumulation)
    callback = StopAt(4) if stop == "step-end" else StopBeforeStep(4)
    train(tmp_path / "cut", [callback], gradient_accumulation_steps=accumulation)
    saved = torch.load(tmp_path / "cut" / "checkpoint-4" / "rng_state.pth", weights_only=False)
    pending = saved["workbench_pending_batches"]
    # the batch collated ahead; at a step's start the step's micro-batches too
    assert len(pending) == (1 if stop == "step-end" else accumulation + 1)
    assert {"python", "numpy", "cpu"} <= set(saved)  # transformers' keys, as it reads them
    resumed = train(tmp_path / "cut", resume=True, gradient_accumulation_steps=accumulation)
    assert losses(resumed) == losses(full) and len(losses(full)) == 9
    assert_same_weights(weights(resumed), weights(full))


def test_collators_known_to_draw_nothing_are_not_tracked():
    """Tracking costs a capture of three streams per batch: the collators that draw nothing
    (workbench's and transformers' padding and default ones) go without it."""
    assert not draws_random(default_data_collator)
    assert not draws_random(DataCollatorWithPadding(tokenizer=None))
    assert draws_random(noisy_collator) and draws_random(lambda rows: rows)
    tracked = CollationRng(noisy_collator, keep=2)
    assert tracked.pending(trained=0) == []
    tracked(list(TRAIN)[:2]), tracked(list(TRAIN)[2:4]), tracked(list(TRAIN)[4:6])
    assert len(tracked.pending(trained=1)) == 2  # only the newest `keep` are remembered
