"""Where an HF Trainer user can tell, workbench behaves as transformers' Trainer (issue 16).

Each test pins HF's rule; where transformers is installed (the test extra has it) the test
also runs transformers' own object side by side and compares.
"""

from __future__ import annotations

import json

import pytest
import torch

from workbench import (
    DEFAULT_CALLBACKS,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from workbench.core.callbacks import CallbackHandler

from support import StopAt, hf_logs, make_args

try:
    import transformers.trainer_callback as hf_callbacks
except ImportError:  # the parity half of each test runs where transformers is installed
    hf_callbacks = None


class Regressor(torch.nn.Module):
    loss_type = "ForSequenceClassification"

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return {"logits": self.linear(x)}


def data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)} for i in range(n)]


class Scripted(TrainerCallback):
    """Replaces the eval metrics with a scripted score per step."""

    def __init__(self, script: dict[int, float]) -> None:
        self.script = script

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_score"] = self.script[state.global_step]


def trainer(out, callbacks=(), **overrides) -> Trainer:
    torch.manual_seed(0)
    args = make_args(out, per_device_train_batch_size=4, per_device_eval_batch_size=8, **overrides)
    evals = data(8) if overrides.get("eval_strategy", "no") != "no" else None
    return Trainer(model=Regressor(), args=args, train_dataset=data(), eval_dataset=evals, callbacks=list(callbacks))


# -- 8. TrainerState.epoch ------------------------------------------------------------------


def test_trainer_state_epoch_defaults_to_zero():
    assert TrainerState().epoch == 0
    assert int(TrainerState().epoch) == 0  # what HF callbacks do
    if hf_callbacks is not None:
        assert TrainerState().epoch == hf_callbacks.TrainerState().epoch


# -- 9. hooks and exports -------------------------------------------------------------------


HF_HOOKS = {"on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
            "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate",
            "on_predict", "on_save", "on_log", "on_prediction_step", "on_push_begin"}


def test_every_hf_hook_exists_on_callbacks_and_the_handler():
    hooks = HF_HOOKS
    if hf_callbacks is not None:
        hooks = {name for name in vars(hf_callbacks.CallbackHandler) if name.startswith("on_")}
        assert HF_HOOKS <= hooks
    for name in hooks:
        assert callable(getattr(TrainerCallback, name)), name
        assert callable(getattr(CallbackHandler, name)), name

    class Pushed(TrainerCallback):
        def on_push_begin(self, args, state, control, **kwargs):
            control.should_log = True

    handler = CallbackHandler([Pushed()], None, None, None, None)
    assert handler.on_push_begin(None, TrainerState(), TrainerControl()).should_log


def test_default_callbacks_and_the_progress_printer_have_hf_meanings(tmp_path, capsys):
    assert DEFAULT_CALLBACKS == [DefaultFlowCallback]
    shown = trainer(tmp_path / "a", max_steps=2, disable_tqdm=False)
    kinds = [type(cb) for cb in shown.callback_handler.callbacks]
    assert ProgressCallback in kinds and PrinterCallback not in kinds
    # disable_tqdm: HF's bare printer, one dict per log, floats as .4g, without total_flos.
    bare = trainer(tmp_path / "b", max_steps=2, disable_tqdm=True)
    assert PrinterCallback in [type(cb) for cb in bare.callback_handler.callbacks]
    capsys.readouterr()
    bare.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 3 and lines[0].startswith("{'loss': '") and "total_flos" not in lines[-1]
    if hf_callbacks is not None:
        hf_printer = hf_callbacks.PrinterCallback()
        logs = dict(bare.state.log_history[0])
        logs.pop("step")
        hf_printer.on_log(bare.args, bare.state, bare.control, logs=dict(logs))
        PrinterCallback().on_log(bare.args, bare.state, bare.control, logs=dict(logs))
        hf_line, our_line = capsys.readouterr().out.splitlines()
        assert our_line == hf_line


def test_a_duplicate_callback_is_added_with_hf_warning(caplog):
    with hf_logs(caplog, "transformers.trainer_callback"):
        handler = CallbackHandler([DefaultFlowCallback, EarlyStoppingCallback(2), EarlyStoppingCallback(3)],
                                  None, None, None, None)
    assert len(handler.callbacks) == 3
    assert "You are adding a EarlyStoppingCallback to the callbacks of this Trainer, but there is already one" \
        in caplog.text


# -- 2. stateful callbacks ------------------------------------------------------------------


def test_early_stopping_check_metric_value_follows_hf():
    args = make_args("unused", metric_for_best_model="score", greater_is_better=True)
    values = [0.5, 0.55, 0.56, 0.54, 0.7, 0.7]
    ours = EarlyStoppingCallback(2, early_stopping_threshold=0.02)
    counters, state = [], TrainerState()
    theirs = hf_callbacks.EarlyStoppingCallback(2, early_stopping_threshold=0.02) if hf_callbacks else None
    hf_counters, hf_state = [], (hf_callbacks.TrainerState() if hf_callbacks else None)
    for value in values:
        ours.check_metric_value(args, state, TrainerControl(), value)
        counters.append(ours.early_stopping_patience_counter)
        state.best_metric = value if state.best_metric is None else max(state.best_metric, value)
        if theirs is not None:
            theirs.check_metric_value(args, hf_state, hf_callbacks.TrainerControl(), value)
            hf_counters.append(theirs.early_stopping_patience_counter)
            hf_state.best_metric = state.best_metric
    # 0.55 beats 0.5 by more than 0.02; 0.56 does not; 0.54 is worse; 0.7 beats 0.56; 0.7 ties.
    assert counters == [0, 0, 1, 2, 0, 1]
    if theirs is not None:
        assert counters == hf_counters


def test_stateful_callbacks_are_rebuilt_from_args_each_instance_and_the_control(tmp_path, caplog):
    script = {s: 1.0 - 0.1 * s for s in range(1, 11)}  # only gets worse after step 1
    options = dict(max_steps=10, eval_strategy="steps", eval_steps=1, metric_for_best_model="score",
                   greater_is_better=True, save_strategy="steps", save_steps=100)
    out = tmp_path / "run"
    first = trainer(out, [Scripted(script), EarlyStoppingCallback(5), EarlyStoppingCallback(7, 0.5), StopAt(3)],
                    **options)
    first.train()
    saved = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["stateful_callbacks"]
    # Two instances of one class: a list, in order, each with its own args and counter.
    assert [s["args"]["early_stopping_patience"] for s in saved["EarlyStoppingCallback"]] == [5, 7]
    assert [s["attributes"]["early_stopping_patience_counter"] for s in saved["EarlyStoppingCallback"]] == [2, 2]
    assert saved["TrainerControl"]["args"]["should_save"] is True

    seen = []

    class Peek(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.extend((cb.early_stopping_patience, cb.early_stopping_threshold, cb.early_stopping_patience_counter)
                        for cb in resumed.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback))

    # Resumed with default-argument instances: the checkpoint's args and counters come back.
    resumed = trainer(out, [Peek(), Scripted(script), EarlyStoppingCallback(), EarlyStoppingCallback()],
                      restore_callback_states_from_checkpoint=True, **options)
    with hf_logs(caplog, "transformers.trainer"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert seen == [(5, 0.0, 2), (7, 0.5, 2)]
    assert resumed.state.global_step == 6  # patience 5 with 2 already counted: steps 4, 5, 6 ...
    assert "Checkpoint included callbacks" not in caplog.text

    # A saved state whose callback is absent is ignored with HF's warning.
    caplog.clear()
    plain = trainer(out, [Scripted(script)], restore_callback_states_from_checkpoint=True, **options)
    with hf_logs(caplog, "transformers.trainer"):
        plain.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert "Checkpoint included callbacks not included in current configuration. Ignoring. (EarlyStoppingCallback)" \
        in caplog.text


# -- 1. the last step, and a resumed run's log_history ------------------------------------------


FLOW_CASES = [
    dict(max_steps=11, logging_steps=3, eval_steps=4, save_steps=5, eval_delay=0),
    dict(max_steps=12, logging_steps=4, eval_steps=6, save_steps=6, eval_delay=0),
    dict(max_steps=10, logging_steps=3, eval_steps=4, save_steps=7, eval_delay=9),
    dict(max_steps=7, logging_steps=2, eval_steps=3, save_steps=3, eval_delay=8, logging_first_step=True),
]


@pytest.mark.parametrize("case", FLOW_CASES)
def test_flow_decisions_at_every_step_match_hf(tmp_path, case):
    case = dict(case)
    max_steps = case.pop("max_steps")
    args = make_args(tmp_path, eval_strategy="steps", save_strategy="steps", max_steps=max_steps, **case)
    state = TrainerState(max_steps=max_steps)
    state.compute_steps(args, max_steps)
    ours = []
    for step in range(1, max_steps + 1):
        state.global_step = step
        control = DefaultFlowCallback().on_step_end(args, state, TrainerControl())
        ours.append((control.should_log, control.should_evaluate, control.should_save, control.should_training_stop))
    # HF's rule, written out: the last step logs only on a logging step, evaluates unless it
    # already does (eval_delay permitting), and saves with save_strategy "steps".
    expected = []
    for step in range(1, max_steps + 1):
        log = (step == 1 and case.get("logging_first_step", False)) or step % case["logging_steps"] == 0
        evaluate = step % case["eval_steps"] == 0 and case["eval_delay"] <= step
        save = step % case["save_steps"] == 0
        last = step >= max_steps
        if last:
            evaluate = evaluate or (step % case["eval_steps"] != 0 and case["eval_delay"] <= step)
            save = True
        expected.append((log, evaluate, save, last))
    assert ours == expected
    if hf_callbacks is not None:
        hf_state = hf_callbacks.TrainerState(max_steps=max_steps)
        hf_state.compute_steps(args, max_steps)
        theirs = []
        for step in range(1, max_steps + 1):
            hf_state.global_step = step
            c = hf_callbacks.DefaultFlowCallback().on_step_end(args, hf_state, hf_callbacks.TrainerControl())
            theirs.append((c.should_log, c.should_evaluate, c.should_save, c.should_training_stop))
        assert ours == theirs


def _comparable(history: list[dict]) -> list[dict]:
    """log_history without the timing metrics and without the train summary (whose train_loss,
    as in HF, covers the steps of that train() call only)."""
    from workbench.core.records import is_timing_metric

    return [{k: v for k, v in entry.items() if not is_timing_metric(k)} for entry in history
            if "train_runtime" not in entry]


@pytest.mark.parametrize("nan_filter", [True, False])
def test_a_resumed_run_logs_exactly_what_an_uninterrupted_one_logs(tmp_path, nan_filter):
    # logging every 3 steps; the checkpoint at step 5 and max_steps 11 are not logging steps,
    # so the resume happens mid-window and the run ends mid-window.
    options = dict(max_steps=11, logging_steps=3, eval_strategy="steps", eval_steps=4, save_strategy="steps",
                   save_steps=5, logging_nan_inf_filter=nan_filter)
    whole = trainer(tmp_path / "whole", **options)
    whole.train()
    cut = trainer(tmp_path / "cut", [StopAt(5)], **options)
    cut.train()
    assert cut.state.global_step == 5
    resumed = trainer(tmp_path / "cut", **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-5"))
    expected = _comparable(whole.state.log_history)
    assert [e["step"] for e in expected if "loss" in e] == [3, 6, 9]  # step 11 is not a logging step
    assert [e["step"] for e in expected if "eval_loss" in e] == [4, 8, 11]  # the last step evaluates
    assert _comparable(resumed.state.log_history) == expected
    saved = json.loads((tmp_path / "cut" / "checkpoint-5" / "workbench_state.json").read_text())
    assert saved["loss_window"]["since_step"] == 3 and len(saved["loss_window"]["losses"]) == 2


# -- 7. save_strategy="best" needs a metric ------------------------------------------------------


def test_save_strategy_best_without_a_metric_is_a_value_error_at_construction(tmp_path):
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="best")
    assert args.metric_for_best_model is None  # not silently "loss"
    with pytest.raises(ValueError, match="metric_for_best_model` must be provided when using 'best' save_strategy"):
        Trainer(model=Regressor(), args=args, train_dataset=data(), eval_dataset=data(8))
    # load_best_model_at_end implies "loss", as in HF.
    implied = make_args(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                        load_best_model_at_end=True)
    assert implied.metric_for_best_model == "loss" and implied.greater_is_better is False
    if hf_callbacks is not None:
        import transformers

        hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), eval_strategy="steps", eval_steps=2,
                                                 save_strategy="best", report_to="none", use_cpu=True)
        assert hf_args.metric_for_best_model is None
        with pytest.raises(ValueError, match="metric_for_best_model` must be provided"):
            transformers.Trainer(model=Regressor(), args=hf_args, train_dataset=data(), eval_dataset=data(8))


# -- 3. label smoothing with a multi-label model ------------------------------------------------


@pytest.mark.skipif(hf_callbacks is None, reason="needs transformers (a model built from a config)")
def test_label_smoothing_is_disabled_for_multi_label_classification_as_in_hf(tmp_path):
    import copy

    import transformers

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3, problem_type="multi_label_classification",
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(1, 50, (6,), generator=g),
             "labels": (torch.rand(3, generator=g) > 0.5).float()} for _ in range(4)]
    options = dict(max_steps=3, per_device_train_batch_size=4, label_smoothing_factor=0.1, learning_rate=1e-2,
                   report_to="none", save_strategy="no", logging_steps=1, use_cpu=True, seed=0)
    with pytest.warns(UserWarning, match="Label smoothing is not compatible with multi-label classification"):
        ours = Trainer(model=copy.deepcopy(model), args=make_args(tmp_path / "ours", **options), train_dataset=rows)
    ours.train()  # before: "Expected input batch_size (4) to match target batch_size (12)"
    ours_losses = [e["loss"] for e in ours.state.log_history if "loss" in e]
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), disable_tqdm=True, **options)
    with pytest.warns(UserWarning, match="Label smoothing is not compatible with multi-label classification"):
        theirs = transformers.Trainer(model=copy.deepcopy(model), args=hf_args, train_dataset=rows)
    theirs.train()
    hf_losses = [e["loss"] for e in theirs.state.log_history if "loss" in e]
    assert len(ours_losses) == 3 and ours_losses == pytest.approx(hf_losses, rel=1e-4)


# -- 4, 5, 9. predict with batched metrics, persistent eval workers, gather_object -------------


def test_predict_with_batch_eval_metrics_returns_predictions_and_labels(tmp_path):
    seen = []

    def metrics(pred, compute_result=False):
        seen.append(compute_result)
        return {"rows": float(len(pred.label_ids))}

    run = Trainer(model=Regressor(), args=make_args(tmp_path, batch_eval_metrics=True, per_device_eval_batch_size=4),
                  train_dataset=data(), eval_dataset=data(8), compute_metrics=metrics)
    out = run.predict(data(10))
    assert out.predictions is not None and out.predictions.shape == (10, 2)
    assert out.label_ids is not None and out.label_ids.tolist() == [i % 2 for i in range(10)]
    assert out.metrics["test_rows"] == 2.0 and seen == [False, False, True]  # batches of 4, 4, 2
    assert "eval_rows" in run.evaluate()  # evaluate() keeps nothing; its metrics come per batch
    with pytest.raises(ValueError, match="compute_metrics must take a compute_result argument"):
        Trainer(model=Regressor(), args=make_args(tmp_path, batch_eval_metrics=True), train_dataset=data(),
                compute_metrics=lambda pred: {})


def test_persistent_eval_workers_are_started_once(tmp_path):
    args = make_args(tmp_path, dataloader_num_workers=1, dataloader_persistent_workers=True,
                     per_device_eval_batch_size=4)
    run = Trainer(model=Regressor(), args=args, train_dataset=data(), eval_dataset={"a": data(8), "b": data(4)})
    first = {name: run.get_eval_dataloader(name) for name in ("a", "b")}
    run.evaluate()
    run.evaluate()
    assert all(run.get_eval_dataloader(name) is loader for name, loader in first.items())
    assert first["a"] is not first["b"]
    # A set passed as itself gets its own loader (HF would hand back the "eval" one).
    assert run.get_eval_dataloader(data(4)) is not run.get_eval_dataloader(data(4))


def test_eval_use_gather_object_is_accepted_and_evaluates(tmp_path):
    run = Trainer(model=Regressor(), args=make_args(tmp_path, eval_use_gather_object=True),
                  train_dataset=data(), eval_dataset=data(8), compute_metrics=lambda p: {"n": float(len(p.predictions))})
    assert run.evaluate()["eval_n"] == 8.0


def test_hf_private_steps_keep_their_names_and_call_order(tmp_path):
    calls = []

    class Sub(Trainer):
        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                     learning_rate=None):
            calls.append(("_maybe_log_save_evaluate", self.state.global_step))
            return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                                    start_time, learning_rate)

        def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=False):
            calls.append(("_evaluate", self.state.global_step))
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)

        def _save_checkpoint(self, model, trial):
            calls.append(("_save_checkpoint", self.state.global_step))
            return super()._save_checkpoint(model, trial)

        def _get_output_dir(self, trial=None):
            calls.append(("_get_output_dir", self.state.global_step))
            return str(tmp_path / "elsewhere")

    torch.manual_seed(0)
    args = make_args(tmp_path / "out", max_steps=2, per_device_train_batch_size=4, eval_strategy="steps",
                     eval_steps=2, save_strategy="steps", save_steps=2)
    Sub(model=Regressor(), args=args, train_dataset=data(), eval_dataset=data(8)).train()
    at_two = [name for name, step in calls if step == 2]
    # The step end, then (as in HF) once more after on_epoch_end, with nothing left to do.
    assert at_two == ["_maybe_log_save_evaluate", "_evaluate", "_save_checkpoint", "_get_output_dir",
                      "_maybe_log_save_evaluate"]
    assert (tmp_path / "elsewhere" / "checkpoint-2" / "manifest.json").is_file()
