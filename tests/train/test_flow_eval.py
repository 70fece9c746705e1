"""Training flow, evaluation, checkpoints, events.jsonl and the CLI, on real tiny runs.

Everything here trains for real (a small MLP or TinyGPT on the CPU); nothing is mocked.
The CLI is exercised through real subprocesses. Each assertion is chosen so that it fails
when the feature it names breaks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench import (
    EarlyStoppingCallback,
    EvalPrediction,
    PredictionOutput,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from workbench import metrics as wb_metrics
from workbench.core.event_file import read_events
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier

from support import StopAt, checkpoint_steps
from support.steering import Recorder

IN_FEATURES, NUM_CLASSES = 8, 3
CHECKPOINT_FILES = {"manifest.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                    "rng_state.pth", "trainer_state.json"}


@pytest.fixture(scope="module")
def data():
    """32 training rows (8 micro-batches of 4) and 8 eval rows (2 eval batches of 4)."""
    return load_builtin_data("random-classification", n_train=32, n_eval=8,
                             in_features=IN_FEATURES, num_classes=NUM_CLASSES, seed=1)


def make_trainer(out: Path, data, callbacks=None, eval_dataset="default", model=None,
                 compute_metrics=None, **kwargs) -> Trainer:
    train, evaluation = data
    settings = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, disable_tqdm=True,
                    report_to="none", learning_rate=1e-2)
    settings.update(kwargs)
    args = TrainingArguments(str(out), **settings)
    return Trainer(
        model=model or MLPClassifier(in_features=IN_FEATURES, hidden=16, num_classes=NUM_CLASSES),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation if eval_dataset == "default" else eval_dataset,
        callbacks=callbacks,
        compute_metrics=compute_metrics,
    )


def logged_steps(trainer: Trainer, key: str) -> list[int]:
    return [entry["step"] for entry in trainer.state.log_history if key in entry]


# -- 1. callback event order -------------------------------------------------------------


def test_callback_event_order_matches_hf(tmp_path, data):
    rec = Recorder()
    trainer = make_trainer(tmp_path / "out", data, callbacks=[rec], max_steps=4, gradient_accumulation_steps=2,
                           logging_steps=2, eval_strategy="steps", eval_steps=2, save_steps=4)
    trainer.train()

    def update(step_before: int, k: int = 2) -> list[tuple[str, int]]:
        return ([("step_begin", step_before)] + [("substep_end", step_before)] * (k - 1)
                + [("pre_optimizer_step", step_before), ("optimizer_step", step_before),
                   ("step_end", step_before + 1)])

    def evaluation(step: int) -> list[tuple[str, int]]:
        # 8 eval rows / batch 4 = 2 prediction steps, then the eval metrics are logged, then on_evaluate.
        return [("prediction_step", step)] * 2 + [("log", step), ("evaluate", step)]

    expected = (
        [("init_end", 0), ("train_begin", 0), ("epoch_begin", 0)]
        + update(0) + update(1) + [("log", 2)] + evaluation(2)
        + update(2) + update(3) + [("log", 4)] + evaluation(4) + [("save", 4)]
        + [("epoch_end", 4), ("log", 4), ("train_end", 4)]
    )
    assert rec.events == expected
    assert checkpoint_steps(tmp_path / "out") == [4]


# -- 2. duck typing, control replacement, stop, add/pop/remove --------------------------------


class DuckCallback:  # deliberately not a TrainerCallback
    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.step_ends: list[int] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(state.global_step)
        return None


def test_duck_typed_callback_receives_hooks(tmp_path, data):
    duck = DuckCallback()
    trainer = make_trainer(tmp_path / "out", data, callbacks=[duck], max_steps=3, logging_steps=1,
                           save_strategy="no")
    trainer.train()
    assert duck.step_ends == [1, 2, 3]
    assert [entry["loss"] for entry in duck.logs if "loss" in entry] == pytest.approx(
        [entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    assert len([entry for entry in duck.logs if "loss" in entry]) == 3
    assert "train_runtime" in duck.logs[-1]


class ReplaceControl(TrainerCallback):
    """At step 2, returns a brand-new TrainerControl asking for a save."""

    def __init__(self) -> None:
        self.returned: TrainerControl | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.returned = TrainerControl(should_save=True)
            return self.returned
        return None


class SeesControl(TrainerCallback):
    def __init__(self) -> None:
        self.seen: dict[int, TrainerControl] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.seen[state.global_step] = control


def test_callback_returning_control_replaces_it(tmp_path, data):
    replace, sees = ReplaceControl(), SeesControl()
    out = tmp_path / "out"
    trainer = make_trainer(out, data, callbacks=[replace, sees], max_steps=3, save_strategy="no")
    trainer.train()
    # The later callback got the replacement object, and the loop acted on it: a save at 2
    # although save_strategy is "no".
    assert sees.seen[2] is replace.returned
    assert sees.seen[1] is not replace.returned
    assert checkpoint_steps(out) == [2]


def test_callback_should_training_stop_stops_at_that_step(tmp_path, data):
    rec = Recorder()
    trainer = make_trainer(tmp_path / "out", data, callbacks=[StopAt(3, save=False), rec], max_steps=20, save_strategy="no")
    output = trainer.train()
    assert output.global_step == 3
    assert trainer.state.global_step == 3
    assert [s for name, s in rec.events if name == "step_end"] == [1, 2, 3]
    end = [e for e in read_events(tmp_path / "out") if e["event"] == "end"]
    assert end and end[-1]["step"] == 3 and end[-1]["status"] == "stopped"


def test_add_pop_remove_callback_with_class_and_instance(tmp_path, data):
    trainer = make_trainer(tmp_path / "out", data, max_steps=2, save_strategy="no")
    handler = trainer.callback_handler

    trainer.add_callback(Recorder)  # a class is instantiated
    added = [cb for cb in handler.callbacks if type(cb) is Recorder]
    assert len(added) == 1
    popped = trainer.pop_callback(Recorder)
    assert popped is added[0]
    assert not any(type(cb) is Recorder for cb in handler.callbacks)
    assert trainer.pop_callback(Recorder) is None

    kept, removed_by_instance, removed_by_class = Recorder(), Recorder(), DuckCallback()
    trainer.add_callback(kept)
    trainer.add_callback(removed_by_instance)
    trainer.add_callback(removed_by_class)
    assert trainer.pop_callback(kept) is kept
    trainer.add_callback(kept)
    trainer.remove_callback(removed_by_instance)
    trainer.remove_callback(DuckCallback)
    assert kept in handler.callbacks
    assert removed_by_instance not in handler.callbacks and removed_by_class not in handler.callbacks
    assert "Recorder" in handler.callback_list

    trainer.train()
    # Removed callbacks get no events (the dispatch table was rebuilt); the kept one does.
    assert removed_by_instance.events == [] and removed_by_class.step_ends == []
    assert [s for name, s in kept.events if name == "step_end"] == [1, 2]


# -- 3. eval_on_start, epoch evaluation, eval_delay --------------------------------------------


def test_eval_on_start_evaluates_before_first_step(tmp_path, data):
    rec = Recorder()
    trainer = make_trainer(tmp_path / "out", data, callbacks=[rec], max_steps=2, eval_strategy="steps",
                           eval_steps=2, eval_on_start=True, save_strategy="no")
    trainer.train()
    names = rec.names()
    assert names.index("evaluate") < names.index("step_begin")
    assert rec.events[names.index("evaluate")] == ("evaluate", 0)
    first = trainer.state.log_history[0]
    assert first["step"] == 0 and "eval_loss" in first
    assert logged_steps(trainer, "eval_loss") == [0, 2]
    evals = [e for e in read_events(tmp_path / "out") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2]


def test_eval_on_start_without_eval_dataset_is_a_clear_error(tmp_path, data):
    # As in HF, the Trainer refuses at construction, before any work (and the CLI exits 2).
    with pytest.raises(ValueError, match="eval_on_start needs an eval_dataset"):
        make_trainer(tmp_path / "out", data, eval_dataset=None, max_steps=2,
                     eval_strategy="steps", eval_steps=1, eval_on_start=True)
    with pytest.raises(ValueError, match="eval_strategy='epoch' needs an eval_dataset"):
        make_trainer(tmp_path / "out", data, eval_dataset=None, max_steps=2, eval_strategy="epoch")


def test_eval_strategy_epoch_evaluates_at_each_epoch_end(tmp_path, data):
    rec = Recorder()
    trainer = make_trainer(tmp_path / "out", data, callbacks=[rec], num_train_epochs=2,
                           gradient_accumulation_steps=2, eval_strategy="epoch", save_strategy="no")
    trainer.train()
    # 8 micro-batches / 2 accumulated = 4 updates per epoch.
    assert trainer.state.global_step == 8
    assert logged_steps(trainer, "eval_loss") == [4, 8]
    assert [e["epoch"] for e in trainer.state.log_history if "eval_loss" in e] == pytest.approx([1.0, 2.0])
    # Each evaluation follows its epoch's end.
    names = rec.names()
    ends = [i for i, n in enumerate(names) if n == "epoch_end"]
    evals = [i for i, n in enumerate(names) if n == "evaluate"]
    assert len(ends) == 2 and len(evals) == 2
    assert ends[0] < evals[0] < ends[1] < evals[1]


def test_eval_delay_postpones_evaluations(tmp_path, data):
    trainer = make_trainer(tmp_path / "out", data, max_steps=5, eval_strategy="steps", eval_steps=1,
                           eval_delay=3, save_strategy="no")
    trainer.train()
    assert logged_steps(trainer, "eval_loss") == [3, 4, 5]


# -- 4. logging and saving strategies, checkpoints, rotation --------------------------------------


def test_logging_first_step_and_steps(tmp_path, data):
    trainer = make_trainer(tmp_path / "out", data, max_steps=6, logging_steps=4, logging_first_step=True,
                           save_strategy="no")
    trainer.train()
    # 1 (first step), 4 (every 4); the last step (6) is no logging step, so, as in HF, it does
    # not log: its loss goes into train_loss.
    assert logged_steps(trainer, "loss") == [1, 4]
    assert all("learning_rate" in e and "grad_norm" in e for e in trainer.state.log_history if "loss" in e)


def test_logging_strategy_epoch_and_no(tmp_path, data):
    trainer = make_trainer(tmp_path / "a", data, num_train_epochs=2, logging_strategy="epoch", logging_steps=1,
                           save_strategy="no")
    trainer.train()
    assert logged_steps(trainer, "loss") == [8, 16]  # 8 updates per epoch

    trainer = make_trainer(tmp_path / "b", data, num_train_epochs=2, logging_strategy="no", logging_steps=1,
                           save_strategy="no")
    trainer.train()
    assert logged_steps(trainer, "loss") == []
    assert "train_loss" in trainer.state.log_history[-1]  # the final summary is still logged


def test_save_strategy_steps_checkpoint_contents(tmp_path, data):
    out = tmp_path / "out"
    rec = Recorder()
    trainer = make_trainer(out, data, callbacks=[rec], max_steps=5, save_strategy="steps", save_steps=2)
    trainer.train()
    # Every 2 steps, plus the last step.
    assert checkpoint_steps(out) == [2, 4, 5]
    assert [s for name, s in rec.events if name == "save"] == [2, 4, 5]
    for step in (2, 4, 5):
        folder = out / f"checkpoint-{step}"
        assert CHECKPOINT_FILES <= {p.name for p in folder.iterdir()}
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["format"] == 1
        for rel, meta in manifest["files"].items():
            assert (folder / rel).stat().st_size == meta["size"]
        assert "model.safetensors" in manifest["files"]
        state = TrainerState.load_from_json(str(folder / "trainer_state.json"))
        assert state.global_step == step
        from workbench.core.rng import numpy_safe_globals

        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            with numpy_safe_globals():  # HF's rng_state.pth layout: NumPy's state is an array
                torch.load(folder / name, weights_only=True)
    assert not list(out.glob(".tmp-*"))


def test_save_strategy_epoch_saves_once_per_epoch(tmp_path, data):
    out = tmp_path / "out"
    rec = Recorder()
    trainer = make_trainer(out, data, callbacks=[rec], num_train_epochs=2, gradient_accumulation_steps=2,
                           save_strategy="epoch")
    trainer.train()
    assert checkpoint_steps(out) == [4, 8]
    # Exactly one save per epoch: the last step must not save a second time.
    assert [s for name, s in rec.events if name == "save"] == [4, 8]


def test_save_strategy_no_writes_no_checkpoint(tmp_path, data):
    out = tmp_path / "out"
    trainer = make_trainer(out, data, max_steps=4, save_strategy="no", save_steps=1)
    trainer.train()
    assert checkpoint_steps(out) == []


def test_save_total_limit_keeps_newest(tmp_path, data):
    out = tmp_path / "out"
    trainer = make_trainer(out, data, max_steps=7, save_strategy="steps", save_steps=2, save_total_limit=2)
    trainer.train()
    assert checkpoint_steps(out) == [6, 7]
    assert not list(out.glob(".trash-*"))


def test_save_total_limit_one_keeps_best_and_newest(tmp_path, data):
    # learning_rate 0: the eval loss never improves after the first evaluation, so step 2 stays
    # the best; with save_total_limit=1 the newest checkpoint must still survive (for resume).
    out = tmp_path / "out"
    trainer = make_trainer(out, data, max_steps=6, learning_rate=0.0, lr_scheduler_type="constant",
                           eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                           save_total_limit=1, metric_for_best_model="loss")
    trainer.train()
    assert trainer.state.best_global_step == 2
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-2"
    assert checkpoint_steps(out) == [2, 6]


# -- 5. compute_metrics, predict, several eval sets, built-in metrics ---------------------------------


def test_compute_metrics_and_predict(tmp_path, data):
    received: list[EvalPrediction] = []

    def compute_metrics(pred: EvalPrediction) -> dict[str, float]:
        received.append(pred)
        return wb_metrics.accuracy(pred)

    train, _ = data
    test_set = load_builtin_data("random-classification", n_train=1, n_eval=10, in_features=IN_FEATURES,
                                 num_classes=NUM_CLASSES, seed=5)[1]
    trainer = make_trainer(tmp_path / "out", data, compute_metrics=compute_metrics, max_steps=2,
                           eval_strategy="steps", eval_steps=2, save_strategy="no")
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 1 and 0.0 <= evals[0]["eval_accuracy"] <= 1.0
    assert isinstance(received[0], EvalPrediction)
    assert received[0].predictions.shape == (8, NUM_CLASSES) and received[0].label_ids.shape == (8,)

    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_accuracy", "eval_runtime"} <= set(metrics)
    assert not any(k == "accuracy" or k == "loss" for k in metrics)

    output = trainer.predict(test_set)
    assert isinstance(output, PredictionOutput)
    # 10 rows in batches of 4: the uneven last batch is concatenated too.
    assert output.predictions.shape == (10, NUM_CLASSES)
    assert output.label_ids.shape == (10,)
    np.testing.assert_array_equal(output.label_ids, test_set.tensors["labels"].numpy())
    assert {"test_loss", "test_accuracy"} <= set(output.metrics)
    assert not any(k.startswith("eval_") for k in output.metrics)
    expected = float((output.predictions.argmax(-1) == output.label_ids).mean())
    assert output.metrics["test_accuracy"] == pytest.approx(expected)
    # The loss matches a direct forward pass.
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(x=test_set.tensors["x"])["logits"]
    np.testing.assert_allclose(output.predictions, logits.numpy(), rtol=1e-5, atol=1e-6)


def test_eval_dataset_dict_prefixes_each_name(tmp_path, data):
    _, ev = data
    other = load_builtin_data("random-classification", n_train=1, n_eval=6, in_features=IN_FEATURES,
                              num_classes=NUM_CLASSES, seed=9)[1]
    trainer = make_trainer(tmp_path / "out", data, eval_dataset={"a": ev, "b": other}, max_steps=2,
                           eval_strategy="steps", eval_steps=2, save_strategy="no")
    trainer.train()
    during = [e for e in trainer.state.log_history if "eval_a_loss" in e]
    assert during and "eval_b_loss" in during[0]

    both = trainer.evaluate()
    assert {"eval_a_loss", "eval_b_loss"} <= set(both)
    assert both["eval_a_loss"] != both["eval_b_loss"]

    only_a = trainer.evaluate(eval_dataset="a")
    assert "eval_a_loss" in only_a and not any(k.startswith("eval_b") for k in only_a)
    assert only_a["eval_a_loss"] == pytest.approx(both["eval_a_loss"])
    with pytest.raises(ValueError, match="a, b"):
        trainer.evaluate(eval_dataset="c")


def test_builtin_metrics_on_hand_made_arrays():
    # accuracy: logits (argmax taken) and class ids; -100 labels are ignored.
    logits = np.array([[0.1, 0.9, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    labels = np.array([1, 0, 1, -100])
    assert wb_metrics.accuracy(EvalPrediction(logits, labels)) == {"accuracy": pytest.approx(2 / 3)}
    assert wb_metrics.accuracy(EvalPrediction(np.array([1, 1, 0, 0]), labels))["accuracy"] == pytest.approx(1 / 3)

    # token_accuracy: prediction at t is compared with the label at t + 1.
    preds = np.array([[5, 6, 7, 0], [1, 2, 3, 4]])
    tokens = np.array([[9, 5, 6, 8], [0, 1, 9, -100]])
    # row 0: (5,5) (6,6) (7,8) -> 2/3; row 1: (1,1) (2,9) masked -> 1/2; total 3/5
    assert wb_metrics.token_accuracy(EvalPrediction(preds, tokens))["accuracy"] == pytest.approx(3 / 5)

    losses = np.array([1.0, 2.0, 3.0])
    assert wb_metrics.perplexity(EvalPrediction(None, None, losses=losses))["perplexity"] == pytest.approx(math.e ** 2)
    with pytest.raises(ValueError, match="include_for_metrics"):
        wb_metrics.perplexity(EvalPrediction(preds, tokens))

    t = torch.tensor([[[0.1, 0.7, 0.2], [0.9, 0.0, 0.1]]])
    assert wb_metrics.argmax_logits(t, None).tolist() == [[1, 0]]
    assert wb_metrics.argmax_logits((t, torch.zeros(1)), None).tolist() == [[1, 0]]

    both = wb_metrics.lm_metrics(EvalPrediction(preds, tokens, losses=losses))
    assert both == {"accuracy": pytest.approx(3 / 5), "perplexity": pytest.approx(math.e ** 2)}


# -- 6. best metric tracking -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["loss", "eval_loss"])
def test_best_metric_tracks_lowest_loss(tmp_path, data, name):
    trainer = make_trainer(tmp_path / "out", data, max_steps=6, eval_strategy="steps", eval_steps=1,
                           save_strategy="no", metric_for_best_model=name, learning_rate=0.05)
    assert trainer.args.greater_is_better is False
    trainer.train()
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 6
    best_step, best = min(evals, key=lambda item: (item[1], item[0]))
    assert trainer.state.best_metric == pytest.approx(best)
    assert trainer.state.best_global_step == best_step


def test_best_metric_greater_is_better_inferred_for_accuracy(tmp_path, data):
    trainer = make_trainer(tmp_path / "out", data, compute_metrics=wb_metrics.accuracy, max_steps=6,
                           eval_strategy="steps", eval_steps=1, save_strategy="no",
                           metric_for_best_model="accuracy", learning_rate=0.05)
    assert trainer.args.greater_is_better is True
    trainer.train()
    evals = [(e["step"], e["eval_accuracy"]) for e in trainer.state.log_history if "eval_accuracy" in e]
    best = max(value for _, value in evals)
    first_best_step = next(step for step, value in evals if value == best)
    assert trainer.state.best_metric == pytest.approx(best)
    assert trainer.state.best_global_step == first_best_step


def test_unknown_metric_for_best_model_lists_returned_names(tmp_path, data):
    trainer = make_trainer(tmp_path / "out", data, compute_metrics=wb_metrics.accuracy, max_steps=2,
                           eval_strategy="steps", eval_steps=1, save_strategy="no",
                           metric_for_best_model="f1")
    with pytest.raises(KeyError) as info:
        trainer.train()
    message = str(info.value)
    assert "eval_f1" in message and "eval_loss" in message and "eval_accuracy" in message


# -- 7. early stopping -----------------------------------------------------------------------------


def test_early_stopping_stops_after_patience(tmp_path, data):
    stopper = EarlyStoppingCallback(early_stopping_patience=2)
    trainer = make_trainer(tmp_path / "out", data, callbacks=[stopper], max_steps=20, learning_rate=0.0,
                           lr_scheduler_type="constant", eval_strategy="steps", eval_steps=1,
                           save_strategy="no", metric_for_best_model="loss")
    trainer.train()
    # Evaluation 1 sets the best; 2 and 3 do not improve (the weights never move) -> stop at 3.
    assert trainer.state.global_step == 3
    assert logged_steps(trainer, "eval_loss") == [1, 2, 3]
    assert stopper.early_stopping_patience_counter == 2


def test_early_stopping_needs_metric_for_best_model(tmp_path, data):
    trainer = make_trainer(tmp_path / "out", data, callbacks=[EarlyStoppingCallback(1)], max_steps=2,
                           eval_strategy="steps", eval_steps=1, save_strategy="no")
    with pytest.raises(ValueError, match="metric_for_best_model"):
        trainer.train()


# -- 8. events.jsonl -------------------------------------------------------------------------------


def test_events_jsonl_records_the_run(tmp_path, data):
    out = tmp_path / "out"
    trainer = make_trainer(out, data, max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=2,
                           save_steps=4, eval_on_start=True)
    trainer.train()
    lines = (out / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert all({"event", "time", "step"} <= set(e) for e in events)
    assert all(isinstance(e["time"], float) and isinstance(e["step"], int) for e in events)
    assert [(e["event"], e["step"]) for e in events] == [
        ("start", 0), ("eval", 0), ("log", 2), ("eval", 2), ("log", 4), ("eval", 4), ("save", 4),
        ("log", 4), ("end", 4),
    ]
    times = [e["time"] for e in events]
    assert times == sorted(times)
    assert events[0]["max_steps"] == 4
    assert "loss" in events[2] and "learning_rate" in events[2]
    assert "eval_loss" in events[3]
    assert events[6]["checkpoint"] == "checkpoint-4"
    assert "train_loss" in events[7]
    assert events[-1]["status"] == "finished"


class FailingModel(MLPClassifier):
    def __init__(self, fail_at_call: int) -> None:
        super().__init__(in_features=IN_FEATURES, hidden=16, num_classes=NUM_CLASSES)
        self.calls = 0
        self.fail_at_call = fail_at_call

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("forward exploded on purpose")
        return super().forward(x, labels=labels, num_items_in_batch=num_items_in_batch)


def test_training_exception_writes_error_event(tmp_path, data):
    out = tmp_path / "out"
    trainer = make_trainer(out, data, model=FailingModel(fail_at_call=3), max_steps=5, save_strategy="no")
    with pytest.raises(RuntimeError, match="exploded"):
        trainer.train()
    events = read_events(out)
    assert events[0]["event"] == "start"
    error = events[-1]
    assert error["event"] == "error" and error["step"] == 2
    assert "RuntimeError: forward exploded on purpose" in error["error"]
    assert "Traceback" in error["traceback"] and "forward exploded on purpose" in error["traceback"]
    assert "def forward" in error["traceback"] or "in forward" in error["traceback"]
    assert not any(e["event"] == "end" for e in events)


# -- 9. TrainerState JSON ----------------------------------------------------------------------------


def test_trainer_state_json_round_trip(tmp_path):
    state = TrainerState(epoch=1.5, global_step=12, max_steps=20, logging_steps=2, eval_steps=4, save_steps=6,
                         train_batch_size=4, num_train_epochs=2, num_input_tokens_seen=1000, total_flos=3.5,
                         log_history=[{"loss": 1.25, "step": 2}, {"eval_loss": 1.0, "step": 4}],
                         best_metric=1.0, best_global_step=4, best_model_checkpoint="out/checkpoint-4",
                         trial_params={"lr": 0.1}, stateful_callbacks={"X": {"args": {}, "attributes": {"n": 1}}})
    path = tmp_path / "state.json"
    state.save_to_json(str(path))
    assert TrainerState.load_from_json(str(path)) == state
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # HF's file alone (save_state writes it)
    # Unknown keys (e.g. from a newer transformers) are ignored.
    raw = json.loads(path.read_text())
    raw["something_new"] = 1
    path.write_text(json.dumps(raw))
    assert TrainerState.load_from_json(str(path)) == state


def test_checkpoint_trainer_state_is_loadable(tmp_path, data):
    out = tmp_path / "out"
    trainer = make_trainer(out, data, max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=2,
                           save_steps=4, metric_for_best_model="loss")
    trainer.train()
    loaded = TrainerState.load_from_json(str(out / "checkpoint-4" / "trainer_state.json"))
    assert loaded.global_step == 4 and loaded.max_steps == 4
    assert loaded.best_metric == trainer.state.best_metric
    assert loaded.best_global_step == trainer.state.best_global_step
    history = [e for e in trainer.state.log_history if "train_runtime" not in e]
    assert loaded.log_history == history
    assert loaded.logging_steps == 2 and loaded.eval_steps == 2 and loaded.save_steps == 4
