"""HF's override points are what train / evaluate / predict really call.

Users subclass Trainer as in transformers and override get_train_dataloader,
get_eval_dataloader, get_test_dataloader, evaluate, evaluation_loop, prediction_step,
compute_loss, training_step, create_optimizer, create_scheduler, log and save_model. Each
test builds a subclass overriding one point (calling super), runs real training,
evaluation or prediction of a tiny model on the CPU, and checks the override was called
with HF's arguments, so a code path that bypasses it fails here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from workbench import Trainer
from workbench.checkpoint.store import CheckpointStore
from workbench.data.builtin import TensorDictDataset
from workbench.data.samplers import EpochRandomSampler, _permutation

from support import make_args as _make_args
from support.small import class_data as _class_data
from support.small import mlp as _mlp

STEPS = 4
BATCH = 4

# Quiet four-step runs of the one-layer MLP on 16 training and 8 evaluation rows.
make_args = functools.partial(_make_args, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                              max_steps=STEPS, use_cpu=True)
mlp = functools.partial(_mlp, n_layer=1)
class_data = functools.partial(_class_data, 16, 8)


def recording(*points: str) -> type[Trainer]:
    """A Trainer subclass overriding ``points``: each records (name, args, kwargs), then calls super."""

    def override(name: str):
        def method(self, *args, **kwargs):
            self.calls.append((name, args, kwargs))
            return getattr(super(cls, self), name)(*args, **kwargs)

        method.__name__ = name
        return method

    cls = type("Recording", (Trainer,), {name: override(name) for name in points})
    return cls


def build(points: tuple[str, ...], tmp_path: Path, **overrides: Any) -> Trainer:
    train, evals = class_data()
    trainer = recording(*points)(model=mlp(), args=make_args(tmp_path, **overrides),
                                 train_dataset=train, eval_dataset=evals)
    trainer.calls = []  # what construction did is not what is checked
    return trainer


def called(trainer: Trainer, name: str) -> list[tuple[tuple, dict]]:
    return [(args, kwargs) for point, args, kwargs in trainer.calls if point == name]


# -------------------------------------------------------------------------------- train


TRAIN_POINTS = ("get_train_dataloader", "training_step", "compute_loss", "create_optimizer", "create_scheduler",
                "log", "save_model", "evaluate", "get_eval_dataloader", "evaluation_loop", "prediction_step")


@pytest.mark.parametrize("point", TRAIN_POINTS)
def test_train_calls_the_override(tmp_path, point):
    # Saves at steps 2 and 4 and evaluates at 2 and 4: every point of a run is reached.
    trainer = build((point,), tmp_path, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2)
    trainer.train()
    assert trainer.state.global_step == STEPS
    assert called(trainer, point), f"train() never called the {point} override"


def test_train_calls_reach_the_overrides_with_hf_arguments(tmp_path):
    trainer = build(TRAIN_POINTS, tmp_path, save_strategy="steps", save_steps=2, eval_strategy="steps",
                    eval_steps=2, gradient_accumulation_steps=2)
    trainer.train()
    assert len(called(trainer, "get_train_dataloader")) == 1
    assert len(called(trainer, "create_optimizer")) == 1
    [(args, kwargs)] = called(trainer, "create_scheduler")
    assert (args, kwargs) in [((STEPS, trainer.optimizer), {}), ((STEPS,), {"optimizer": trainer.optimizer}),
                              ((), {"num_training_steps": STEPS, "optimizer": trainer.optimizer})]
    # One training_step per micro-batch, each with the inputs and the step's target count.
    steps = called(trainer, "training_step")
    assert len(steps) == STEPS * 2
    assert all(isinstance(args[1], dict) and "labels" in args[1] for args, _ in steps)
    # compute_loss: once per micro-batch of training, once per batch of each evaluation.
    eval_batches = 2 * (8 // BATCH)
    assert len(called(trainer, "compute_loss")) == STEPS * 2 + eval_batches
    # The per-step logs, the two evaluations and the final summary all go through log().
    logged = [args[0] for args, _ in called(trainer, "log")]
    assert sum("loss" in logs for logs in logged) == STEPS
    assert sum("eval_loss" in logs for logs in logged) == 2
    assert sum("train_runtime" in logs for logs in logged) == 1
    # Evaluation during training: evaluate() -> get_eval_dataloader(None) -> evaluation_loop.
    assert len(called(trainer, "evaluate")) == 2
    assert [args for args, _ in called(trainer, "get_eval_dataloader")] == [(None,), (None,)]
    loops = called(trainer, "evaluation_loop")
    assert [(args[1], kwargs["metric_key_prefix"]) for args, kwargs in loops] == [("Evaluation", "eval")] * 2
    # Checkpoints: save_model(<the checkpoint's folder>, _internal_call=True), as HF's _save_checkpoint.
    saves = called(trainer, "save_model")
    assert [kwargs for _, kwargs in saves] == [{"_internal_call": True}] * 2
    assert [Path(args[0]).name for args, _ in saves] == [".tmp-checkpoint-2", ".tmp-checkpoint-4"]


def test_train_seeds_an_overridden_loader_per_epoch(tmp_path):
    # An override that builds its own DataLoader: its sampler, collator and generator get
    # each epoch's seed from the loop through the loader (nothing is left on the Trainer).
    seen: list[dict[str, Any]] = []

    class EpochCollator:
        def __init__(self) -> None:
            self.epoch, self.loader = None, None

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __call__(self, rows):
            seen.append({"epoch": self.epoch, "rows": [int(r["idx"]) for r in rows],
                         "seed": self.loader.generator.initial_seed()})
            return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}

    class OwnLoader(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            collator = EpochCollator()
            loader = DataLoader(self.train_dataset, batch_size=BATCH, collate_fn=collator,
                                sampler=EpochRandomSampler(self.train_dataset, seed=5), generator=torch.Generator())
            collator.loader = loader
            return loader

    n = 8
    train = TensorDictDataset(x=torch.randn(n, 8), labels=torch.arange(n) % 4, idx=torch.arange(n))
    trainer = OwnLoader(model=mlp(), args=make_args(tmp_path, max_steps=-1, num_train_epochs=2, data_seed=11),
                        train_dataset=train)
    trainer.train()
    assert trainer.state.global_step == 2 * n // BATCH
    assert [s["epoch"] for s in seen] == [0, 0, 1, 1]
    assert [s["seed"] for s in seen] == [11, 11, 12, 12]  # data_seed + epoch
    # Each epoch's rows follow that epoch's permutation (seed 5 + epoch), not epoch 0's again.
    for epoch in (0, 1):
        assert [r for s in seen if s["epoch"] == epoch for r in s["rows"]] == _permutation(n, 5 + epoch)
    assert _permutation(n, 5) != _permutation(n, 6)


def test_checkpoint_weights_come_from_the_save_model_override(tmp_path):
    class OwnSave(Trainer):
        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
            super().save_model(output_dir, _internal_call)
            Path(output_dir, "extra.txt").write_text(f"step {self.state.global_step}\n")

    train, _ = class_data()
    trainer = OwnSave(model=mlp(), args=make_args(tmp_path, save_strategy="steps", save_steps=2, save_async=True),
                      train_dataset=train)
    trainer.train()
    store = CheckpointStore(tmp_path)
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        assert (folder / "extra.txt").read_text() == f"step {step}\n"
        assert (folder / "model.safetensors").is_file() and (folder / "training_args.json").is_file()
        assert store.verify(folder) == (True, None)  # the manifest covers what the override wrote
    # The override's weights are the ones a resume loads.
    resumed = Trainer(model=mlp(seed=9), args=make_args(tmp_path / "r", max_steps=STEPS), train_dataset=train)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- evaluate / predict


EVAL_POINTS = ("get_eval_dataloader", "evaluation_loop", "prediction_step", "compute_loss", "log")
PREDICT_POINTS = ("get_test_dataloader", "evaluation_loop", "prediction_step", "compute_loss")


@pytest.mark.parametrize("point", EVAL_POINTS)
def test_evaluate_calls_the_override(tmp_path, point):
    trainer = build((point,), tmp_path)
    assert "eval_loss" in trainer.evaluate()
    assert called(trainer, point), f"evaluate() never called the {point} override"


@pytest.mark.parametrize("point", PREDICT_POINTS)
def test_predict_calls_the_override(tmp_path, point):
    trainer = build((point,), tmp_path)
    _, evals = class_data()
    out = trainer.predict(evals)
    assert out.predictions.shape == (8, 4)
    assert called(trainer, point), f"predict() never called the {point} override"


def test_evaluate_and_predict_pass_hf_arguments(tmp_path):
    trainer = build(("get_eval_dataloader", "get_test_dataloader", "evaluation_loop", "prediction_step"), tmp_path)
    _, evals = class_data()
    trainer.evaluate(ignore_keys=["hidden"], metric_key_prefix="dev")
    assert [args for args, _ in called(trainer, "get_eval_dataloader")] == [(None,)]
    [(args, kwargs)] = called(trainer, "evaluation_loop")
    assert args[1] == "Evaluation" and kwargs == {"ignore_keys": ["hidden"], "metric_key_prefix": "dev"}
    steps = called(trainer, "prediction_step")
    assert len(steps) == 8 // BATCH and all(kwargs == {"ignore_keys": ["hidden"]} for _, kwargs in steps)

    trainer.calls = []
    trainer.predict(evals)
    assert [args for args, _ in called(trainer, "get_test_dataloader")] == [(evals,)]
    [(args, kwargs)] = called(trainer, "evaluation_loop")
    assert args[1] == "Prediction" and kwargs["metric_key_prefix"] == "test"


def test_named_eval_sets_reach_get_eval_dataloader_as_in_hf(tmp_path):
    # The Trainer's own named sets are passed by name, a dict given to evaluate() set by set.
    train, evals = class_data()
    sets = {"a": evals, "b": torch.utils.data.Subset(evals, range(4))}
    trainer = recording("get_eval_dataloader")(model=mlp(), args=make_args(tmp_path), train_dataset=train,
                                               eval_dataset=sets)
    trainer.calls = []
    metrics = trainer.evaluate()
    assert {"eval_a_loss", "eval_b_loss"} <= set(metrics)
    assert [args for args, _ in called(trainer, "get_eval_dataloader")] == [("a",), ("b",)]
    trainer.calls = []
    trainer.evaluate(sets)
    assert [args[0] for args, _ in called(trainer, "get_eval_dataloader")] == [sets["a"], sets["b"]]


def test_an_eval_dataloader_override_decides_what_is_evaluated(tmp_path):
    # Not a recorder: the override returns a loader over half the set, and evaluate reports that.
    class Half(Trainer):
        def get_eval_dataloader(self, eval_dataset=None):
            half = torch.utils.data.Subset(self.eval_dataset, range(4))
            return DataLoader(half, batch_size=BATCH, collate_fn=self.data_collator)

    train, evals = class_data()
    half = Half(model=mlp(), args=make_args(tmp_path), train_dataset=train, eval_dataset=evals).evaluate()
    full = Trainer(model=mlp(), args=make_args(tmp_path), train_dataset=train, eval_dataset=evals).evaluate()
    reference = Trainer(model=mlp(), args=make_args(tmp_path), train_dataset=train,
                        eval_dataset=torch.utils.data.Subset(evals, range(4))).evaluate()
    assert half["eval_loss"] == pytest.approx(reference["eval_loss"])
    assert half["eval_loss"] != pytest.approx(full["eval_loss"])
