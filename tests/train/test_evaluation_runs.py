"""Evaluation inside real runs, as the reference specifies: precision modes, greater_is_better
and the best metric, unknown metrics with several eval sets, a stop requested during an
evaluation, the reference's own code examples as written, NaN eval batches and predict
without labels.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from workbench import EvalPrediction, Trainer, TrainerCallback, TrainingArguments
from workbench import metrics as wb_metrics

from support.eval_lm import SEQ, TinyLM, batch_bytes, eval_logs, lm_rows, make_args, token_accuracy

# -- 8. precision modes --------------------------------------------------------------------------------


def test_bf16_full_eval_runs_on_cpu_close_to_fp32(tmp_path):
    rows = lm_rows(16, seed=8)
    fp32 = Trainer(model=TinyLM(scale=3.0), args=make_args(tmp_path / "a"), eval_dataset=rows).evaluate()
    trainer = Trainer(model=TinyLM(scale=3.0), args=make_args(tmp_path / "b", bf16_full_eval=True), eval_dataset=rows)
    bf16 = trainer.evaluate()
    assert bf16["eval_loss"] == pytest.approx(fp32["eval_loss"], abs=0.05)
    assert bf16["eval_loss"] != fp32["eval_loss"]  # it really ran in bf16
    out = trainer.predict(rows)
    assert out.predictions.dtype == np.float32  # bf16 logits come back as float32 arrays
    assert next(trainer.model.parameters()).dtype == torch.float32  # weights untouched


def test_fp16_full_eval_is_accepted_on_cpu_as_in_hf_and_runs_in_fp16(tmp_path):
    rows = lm_rows(16, seed=8)
    fp32 = Trainer(model=TinyLM(scale=3.0), args=make_args(tmp_path / "a"), eval_dataset=rows).evaluate()
    trainer = Trainer(model=TinyLM(scale=3.0), args=make_args(tmp_path / "b", fp16_full_eval=True, use_cpu=True),
                      eval_dataset=rows)
    fp16 = trainer.evaluate()
    assert fp16["eval_loss"] == pytest.approx(fp32["eval_loss"], abs=0.01)
    assert fp16["eval_loss"] != fp32["eval_loss"]  # it really ran in fp16
    assert next(trainer.model.parameters()).dtype == torch.float32  # weights untouched


# -- 9. greater_is_better and best metric ---------------------------------------------------------------


@pytest.mark.parametrize("name, explicit, expected", [
    ("loss", None, False), ("eval_loss", None, False), ("score_loss", None, False),
    ("accuracy", None, True), ("eval_accuracy", None, True), ("loss_ratio", None, True),
    ("loss", True, True), ("accuracy", False, False),
])
def test_greater_is_better_inference(tmp_path, name, explicit, expected):
    args = make_args(tmp_path, metric_for_best_model=name, greater_is_better=explicit)
    assert args.greater_is_better is expected


def test_greater_is_better_unset_without_metric(tmp_path):
    assert make_args(tmp_path).greater_is_better is None


SCRIPT = [0.3, 0.2, 0.5, 0.2, 0.5]


@pytest.mark.parametrize("key, metric, explicit, best, best_step", [
    ("score", "score", None, 0.5, 3),               # inferred higher-is-better; tie at 5 keeps 3
    ("score", "eval_score", False, 0.2, 2),         # explicit lower-is-better; tie at 4 keeps 2
    ("score_loss", "score_loss", None, 0.2, 2),     # "...loss": inferred lower-is-better
    ("score_loss", "eval_score_loss", True, 0.5, 3),
])
def test_best_metric_over_a_scripted_run(tmp_path, key, metric, explicit, best, best_step):
    values = iter(SCRIPT)

    def scripted(pred):
        return {key: next(values)}

    rows = lm_rows(16, seed=9)
    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path, max_steps=5, eval_strategy="steps", eval_steps=1,
                                                     metric_for_best_model=metric, greater_is_better=explicit,
                                                     learning_rate=1e-3),
                      train_dataset=rows, eval_dataset=rows[:8], compute_metrics=scripted)
    trainer.train()
    assert [e[f"eval_{key}"] for e in eval_logs(trainer)] == SCRIPT
    assert trainer.state.best_metric == best
    assert trainer.state.best_global_step == best_step


# -- 10. unknown metric with several eval sets ----------------------------------------------------------


def test_unknown_metric_with_dict_eval_sets_lists_the_prefixed_names(tmp_path):
    rows = lm_rows(16, seed=10)
    sets = {"a": lm_rows(8, seed=11), "b": lm_rows(8, seed=12)}
    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1,
                                                     metric_for_best_model="loss"),
                      train_dataset=rows, eval_dataset=sets)
    with pytest.raises(KeyError) as info:
        trainer.train()
    message = str(info.value)
    assert "'eval_loss'" in message and "eval_a_loss" in message and "eval_b_loss" in message
    assert "runtime" not in message

    # Naming one set's metric works, lower-is-better inferred from "loss".
    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path / "ok", max_steps=3, eval_strategy="steps",
                                                     eval_steps=1, metric_for_best_model="a_loss",
                                                     learning_rate=0.05),
                      train_dataset=rows, eval_dataset=sets)
    assert trainer.args.greater_is_better is False
    trainer.train()
    history = [(e["step"], e["eval_a_loss"]) for e in eval_logs(trainer, "eval_a_loss")]
    assert len(history) == 3
    step, value = min(history, key=lambda item: (item[1], item[0]))
    assert trainer.state.best_metric == pytest.approx(value) and trainer.state.best_global_step == step


# -- 11. stop during evaluation -------------------------------------------------------------------------


class StopInsideEval(TrainerCallback):
    """Counts prediction steps per global step; asks to stop on one eval batch."""

    def __init__(self, at_step: int, at_batch: int = 2) -> None:
        self.at_step, self.at_batch = at_step, at_batch
        self.calls: dict[int, int] = defaultdict(int)

    def on_prediction_step(self, args, state, control, **kwargs):
        self.calls[state.global_step] += 1
        if state.global_step == self.at_step and self.calls[state.global_step] == self.at_batch:
            control.should_training_stop = True


def _stop_setup(tmp_path, max_steps: int, callback: StopInsideEval) -> Trainer:
    # 10 eval batches of 4: the first two are easy (one repeated token: loss ~0), the rest
    # random (high loss), so an evaluation cut after two batches reports a much lower loss
    # than a complete one -- it would become the best metric if it were counted.
    easy = lm_rows(8, seed=13, repeat=1.0)
    hard = lm_rows(32, seed=14, repeat=0.0)
    return Trainer(model=TinyLM(scale=30.0),
                   args=make_args(tmp_path, max_steps=max_steps, eval_strategy="steps", eval_steps=2,
                                  per_device_eval_batch_size=4, metric_for_best_model="loss", learning_rate=0.0),
                   train_dataset=lm_rows(16, seed=15), eval_dataset=easy + hard, callbacks=[callback])


def test_stop_requested_during_evaluation_is_honoured_at_next_batch(tmp_path):
    callback = StopInsideEval(at_step=4)
    trainer = _stop_setup(tmp_path, max_steps=8, callback=callback)
    trainer.train()
    assert dict(callback.calls) == {2: 10, 4: 2}  # the step-4 evaluation stopped after batch 2
    assert trainer.state.global_step == 4
    first, cut = eval_logs(trainer)
    assert first["step"] == 2 and "eval_interrupted" not in first
    assert cut["step"] == 4 and cut["eval_interrupted"] is True
    assert cut["eval_loss"] < first["eval_loss"] / 10  # only the easy batches were seen
    # The interrupted evaluation does not count towards the best metric.
    assert trainer.state.best_metric == pytest.approx(first["eval_loss"])
    assert trainer.state.best_global_step == 2


def test_final_evaluation_at_max_steps_is_not_interrupted(tmp_path):
    # At max_steps the flow has already set should_training_stop before evaluating: that
    # request (and the callback repeating it) must not cut the final evaluation short.
    callback = StopInsideEval(at_step=4)
    trainer = _stop_setup(tmp_path, max_steps=4, callback=callback)
    trainer.train()
    assert dict(callback.calls) == {2: 10, 4: 10}
    evals = eval_logs(trainer)
    assert [e["step"] for e in evals] == [2, 4]
    assert not any("eval_interrupted" in e for e in evals)
    assert trainer.state.best_global_step in (2, 4)
    assert trainer.state.best_metric == pytest.approx(min(e["eval_loss"] for e in evals))


# -- 12. the reference's examples, as written ------------------------------------------------------------


class LocalAccuracy:
    """Stands in for ``evaluate.load("accuracy")``."""

    def compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean())}


@pytest.fixture
def example_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write to output_dir="out"
    return dict(model=TinyLM(), train_dataset=lm_rows(16, seed=20), eval_dataset=lm_rows(160, seed=21),
                compute_metrics=token_accuracy)


def test_reference_example_eval_on_start(example_inputs, tmp_path):
    model, train_dataset = example_inputs["model"], example_inputs["train_dataset"]
    eval_dataset, compute_metrics = example_inputs["eval_dataset"], example_inputs["compute_metrics"]
    # ---- reference example (transformers -> workbench) ----
    from workbench import Trainer

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir="out",
            eval_strategy="epoch",
            eval_on_start=True,
        ),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    # ---- end of example ----
    evals = eval_logs(trainer, "eval_accuracy")
    # 16 rows / batch 8 = 2 steps per epoch, 3 epochs: before step 1, then each epoch end.
    assert [e["step"] for e in evals] == [0, 2, 4, 6]
    assert (tmp_path / "out").is_dir()


def test_reference_example_eval_accumulation_steps(example_inputs):
    model, eval_dataset = example_inputs["model"], example_inputs["eval_dataset"]
    compute_metrics = example_inputs["compute_metrics"]
    train_dataset = example_inputs["train_dataset"]
    # ---- reference example (transformers -> workbench; train_dataset added: train() needs one) ----
    from workbench import Trainer

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir="out",
            eval_strategy="epoch",
            eval_accumulation_steps=16,   # move predictions to CPU every 16 batches
        ),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    # ---- end of example ----
    evals = eval_logs(trainer, "eval_accuracy")
    assert len(evals) == 3
    # 20 eval batches: at most 16 of them (logits + labels) were on the device at once.
    per_batch = batch_bytes(8, SEQ, 64) + batch_bytes(8, SEQ, None)
    assert trainer.eval_peak_device_bytes == 16 * per_batch


def test_reference_example_preprocess_logits_for_metrics(example_inputs):
    model, eval_dataset = example_inputs["model"], example_inputs["eval_dataset"]
    train_dataset = example_inputs["train_dataset"]
    # ---- reference example (transformers -> workbench; evaluate.load -> a local metric;
    #      train_dataset added: train() needs one) ----
    from workbench import Trainer

    metric = LocalAccuracy()

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        return metric.compute(predictions=preds, references=labels)

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir="out",
            eval_strategy="epoch",
            eval_accumulation_steps=16,
        ),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )
    trainer.train()
    # ---- end of example ----
    evals = eval_logs(trainer, "eval_accuracy")
    assert len(evals) == 3
    # Only ids (and labels) were accumulated: 16 batches of int64 [8, 16] each, twice.
    assert trainer.eval_peak_device_bytes == 16 * 2 * batch_bytes(8, SEQ, None)
    # The accuracy matches the same metric computed from full logits.
    full = trainer.predict(eval_dataset)
    preds = full.predictions  # argmax ids (preprocessing applies to predict too)
    assert preds.shape == (160, SEQ)
    expected = wb_metrics.token_accuracy(EvalPrediction(preds, full.label_ids))["accuracy"]
    assert evals[-1]["eval_accuracy"] == pytest.approx(expected)


# -- NaN batches and the eval loss (logging_nan_inf_filter) ---------------------------------------


class NaNLossLM(TinyLM):
    def forward(self, input_ids, labels=None, attention_mask=None):
        out = super().forward(input_ids, labels)
        if labels is not None and int(input_ids[0, 0]) in self.bad_first_tokens:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_nan_eval_batches_are_filtered_as_the_reference_says(tmp_path):
    # With logging_nan_inf_filter (default True) NaN/Inf batches are left out of eval_loss;
    # without it they show; if every batch is NaN the loss is NaN, never missing.
    rows = lm_rows(16, seed=31)
    model = NaNLossLM()
    model.bad_first_tokens = {int(rows[8]["input_ids"][0])}  # the second batch
    clean = Trainer(model=model, args=make_args(tmp_path), eval_dataset=rows[:8]).evaluate()
    filtered = Trainer(model=model, args=make_args(tmp_path), eval_dataset=rows).evaluate()
    assert filtered["eval_loss"] == pytest.approx(clean["eval_loss"])
    raw = Trainer(model=model, args=make_args(tmp_path, logging_nan_inf_filter=False), eval_dataset=rows).evaluate()
    assert np.isnan(raw["eval_loss"])
    model.bad_first_tokens = {int(rows[0]["input_ids"][0]), int(rows[8]["input_ids"][0])}
    all_bad = Trainer(model=model, args=make_args(tmp_path), eval_dataset=rows).evaluate()
    assert "eval_loss" in all_bad and np.isnan(all_bad["eval_loss"])


# -- 13. predict without labels ----------------------------------------------------------------------------


def test_predict_without_labels(tmp_path):
    rows = lm_rows(12, seed=30, labels=False)
    called = []
    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path), compute_metrics=lambda p: called.append(p) or {})
    out = trainer.predict(rows)
    assert out.predictions.shape == (12, SEQ, 64)
    assert out.label_ids is None
    assert "test_loss" not in out.metrics
    assert out.metrics and all(k.startswith("test_") for k in out.metrics)
    assert not called
