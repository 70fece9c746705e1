"""Evaluation as the reference specifies (issue 3): memory-bounded accumulation, batched
metrics, include_for_metrics, dynamic shapes, precision modes, best-metric tracking, stop
during evaluation, and the reference's own code examples.

Everything runs real models on the CPU. The language model used throughout is built so its
predictions are meaningful without training: the head is the (unit-norm) embedding matrix
scaled up, so the argmax at position t is the input token at t. Sequences that repeat their
previous token are therefore predicted right, random continuations wrong, which gives
next-token accuracies strictly between 0 and 1 and losses that differ between easy and hard
rows.
"""

from __future__ import annotations

from collections import defaultdict

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench import EvalPrediction, Trainer, TrainerCallback, TrainingArguments
from workbench import metrics as wb_metrics
from workbench.train.evaluation import concat_batches, pad_and_concat
from conftest import make_args as _make_args

SEQ = 16


make_args = functools.partial(_make_args, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                              logging_steps=500)


# -- models and data -----------------------------------------------------------------------


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
    return logits.argmax(dim=-1)


def batch_bytes(batch: int, seq: int, vocab: int | None) -> int:
    """Bytes of one batch's float32 logits (vocab given) or int64 ids/labels."""
    return batch * seq * vocab * 4 if vocab else batch * seq * 8


def _evals(trainer: Trainer, key: str = "eval_loss") -> list[dict]:
    return [entry for entry in trainer.state.log_history if key in entry]


# -- 1-2. memory held by accumulated predictions --------------------------------------------------

BIG_VOCAB, MEM_ROWS, MEM_BATCH = 32000, 64, 8


@pytest.fixture(scope="module")
def big_lm_eval():
    return lm_rows(MEM_ROWS, vocab=BIG_VOCAB, seed=3)


def test_accumulation_with_argmax_holds_a_small_fraction_of_default_and_same_metrics(tmp_path, big_lm_eval):
    default = Trainer(model=TinyLM(vocab=BIG_VOCAB), args=make_args(tmp_path / "a"),
                      eval_dataset=big_lm_eval, compute_metrics=token_accuracy)
    m_default = default.evaluate()
    peak_default = default.eval_peak_device_bytes

    lean = Trainer(model=TinyLM(vocab=BIG_VOCAB), args=make_args(tmp_path / "b", eval_accumulation_steps=2),
                   eval_dataset=big_lm_eval, compute_metrics=token_accuracy,
                   preprocess_logits_for_metrics=argmax)
    m_lean = lean.evaluate()
    peak_lean = lean.eval_peak_device_bytes

    # Measured: default 131_080_192 bytes (64 x 16 x 32000 float32 logits + int64 labels, all
    # held until the end); accumulation 2 + argmax 4_096 bytes (2 batches of int64 ids and
    # labels) -- 0.003 % of the default.
    print(f"\neval peak device bytes: default={peak_default} accum2+argmax={peak_lean}")
    assert peak_default == MEM_ROWS * SEQ * BIG_VOCAB * 4 + batch_bytes(MEM_ROWS, SEQ, None)
    assert peak_lean == 2 * (batch_bytes(MEM_BATCH, SEQ, None) * 2)
    assert peak_lean < 0.01 * peak_default

    assert 0.2 < m_default["eval_accuracy"] < 0.9  # meaningful, not all right or all wrong
    assert m_lean["eval_accuracy"] == m_default["eval_accuracy"]
    assert m_lean["eval_loss"] == m_default["eval_loss"]


def test_eval_accumulation_steps_alone_bounds_device_bytes_to_n_batches(tmp_path, big_lm_eval):
    default = Trainer(model=TinyLM(vocab=BIG_VOCAB), args=make_args(tmp_path / "a"),
                      eval_dataset=big_lm_eval, compute_metrics=token_accuracy)
    out_default = default.predict(big_lm_eval)
    peak_default = default.eval_peak_device_bytes

    accumulated = Trainer(model=TinyLM(vocab=BIG_VOCAB), args=make_args(tmp_path / "b", eval_accumulation_steps=3),
                          eval_dataset=big_lm_eval, compute_metrics=token_accuracy)
    out_acc = accumulated.predict(big_lm_eval)
    per_batch = batch_bytes(MEM_BATCH, SEQ, BIG_VOCAB) + batch_bytes(MEM_BATCH, SEQ, None)
    assert accumulated.eval_peak_device_bytes == 3 * per_batch
    assert peak_default == 8 * per_batch
    # Same predictions, labels and metrics (except timings) as the default path.
    np.testing.assert_array_equal(out_acc.predictions, out_default.predictions)
    np.testing.assert_array_equal(out_acc.label_ids, out_default.label_ids)
    drop = ("_runtime", "_per_second")
    assert ({k: v for k, v in out_acc.metrics.items() if not k.endswith(drop)}
            == {k: v for k, v in out_default.metrics.items() if not k.endswith(drop)})


# -- 3. batch_eval_metrics -------------------------------------------------------------------------


def test_batch_eval_metrics_calls_per_batch_and_returns_last_result(tmp_path):
    rows = lm_rows(20, seed=1)  # batches of 8, 8, 4
    calls = []
    correct = [0, 0]

    def compute_metrics(pred: EvalPrediction, compute_result: bool) -> dict[str, float]:
        preds = torch.as_tensor(pred.predictions)
        labels = torch.as_tensor(pred.label_ids)
        calls.append((tuple(preds.shape), tuple(labels.shape), tuple(torch.as_tensor(pred.losses).shape),
                      compute_result))
        hit = preds.argmax(-1)[:, :-1] == labels[:, 1:]
        correct[0] += int(hit.sum())
        correct[1] += hit.numel()
        if not compute_result:
            return {"partial": 1.0}
        return {"accuracy": correct[0] / correct[1], "batches": float(len(calls))}

    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path, batch_eval_metrics=True, include_for_metrics=["loss"]),
                      eval_dataset=rows, compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    # One call per batch, each seeing only that batch; compute_result only on the last.
    assert calls == [((8, SEQ, 64), (8, SEQ), (8,), False),
                     ((8, SEQ, 64), (8, SEQ), (8,), False),
                     ((4, SEQ, 64), (4, SEQ), (4,), True)]
    assert metrics["eval_batches"] == 3.0
    assert "eval_partial" not in metrics and "partial" not in metrics and "accuracy" not in metrics
    assert "eval_loss" in metrics
    # The accumulated result equals the concatenated computation.
    reference = Trainer(model=TinyLM(), args=make_args(tmp_path / "ref"), eval_dataset=rows,
                        compute_metrics=token_accuracy).evaluate()
    assert metrics["eval_accuracy"] == pytest.approx(reference["eval_accuracy"])
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"])
    # Nothing accumulated besides the batch being scored.
    assert trainer.eval_peak_device_bytes <= 8 * 4


class Streamed(torch.utils.data.IterableDataset):
    """An eval set without a length."""

    def __init__(self, rows) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_batch_eval_metrics_flags_the_last_batch_of_an_iterable_eval_set(tmp_path):
    flags = []

    def compute_metrics(pred, compute_result):
        flags.append(compute_result)
        return {"final": 1.0} if compute_result else {"partial": 1.0}

    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path, batch_eval_metrics=True),
                      eval_dataset=Streamed(lm_rows(20, seed=1)), compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    assert flags == [False, False, True]
    assert metrics["eval_final"] == 1.0 and "eval_partial" not in metrics


# -- 4. eval_do_concat_batches=False ------------------------------------------------------------------


def test_eval_do_concat_batches_false_keeps_a_list_per_batch(tmp_path):
    rows = lm_rows(20, seed=2)
    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path, eval_do_concat_batches=False))
    out = trainer.predict(rows)
    assert isinstance(out.predictions, list) and isinstance(out.label_ids, list)
    assert [p.shape for p in out.predictions] == [(8, SEQ, 64), (8, SEQ, 64), (4, SEQ, 64)]
    assert [lab.shape for lab in out.label_ids] == [(8, SEQ), (8, SEQ), (4, SEQ)]
    np.testing.assert_array_equal(np.concatenate(out.label_ids), torch.stack([r["labels"] for r in rows]).numpy())
    concatenated = Trainer(model=TinyLM(), args=make_args(tmp_path / "c")).predict(rows)
    np.testing.assert_array_equal(np.concatenate(out.predictions), concatenated.predictions)
    assert out.metrics["test_loss"] == pytest.approx(concatenated.metrics["test_loss"])


# -- 5. include_for_metrics ---------------------------------------------------------------------------


@pytest.mark.parametrize("include", [["inputs"], ["loss"], ["inputs", "loss"]])
def test_include_for_metrics_passes_inputs_and_losses(tmp_path, include):
    rows = lm_rows(20, seed=4)
    seen: list[EvalPrediction] = []

    def compute_metrics(pred):
        seen.append(pred)
        return {}

    model = TinyLM()
    trainer = Trainer(model=model, args=make_args(tmp_path, include_for_metrics=include), eval_dataset=rows,
                      compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    (pred,) = seen
    ids = torch.stack([r["input_ids"] for r in rows]).numpy()
    assert len(pred) == 2 + len(include)
    elements = list(pred)
    assert len(elements) == 2 + len(include)
    if "inputs" in include:
        np.testing.assert_array_equal(pred.inputs, ids)
        np.testing.assert_array_equal(elements[2], ids)
    else:
        assert pred.inputs is None
    if "loss" in include:
        losses = np.asarray(pred.losses)
        assert losses.shape == (20,)
        assert elements[-1] is pred.losses
        # Each sample carries its batch's mean loss.
        with torch.no_grad():
            for start in (0, 8, 16):
                batch = torch.stack([r["input_ids"] for r in rows[start:start + 8]])
                expected = model(batch, labels=batch)["loss"].item()
                np.testing.assert_allclose(losses[start:start + len(batch)], expected, rtol=1e-6)
        assert float(losses.mean()) != pytest.approx(float(losses[0]))  # differs across batches
        assert metrics["eval_loss"] == pytest.approx(float(losses.mean()), rel=1e-6)
    else:
        assert pred.losses is None


# -- 6. dynamic shapes --------------------------------------------------------------------------------


def _varlen_rows() -> list[dict[str, torch.Tensor]]:
    lengths = [5, 3, 5, 4, 9, 2, 7, 9, 3, 1]  # batches of 4: max 5, 9, 3
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": torch.randint(1, 64, (n,), generator=g)} for n in lengths]


def pad_per_batch(features):
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = f["input_ids"]
        labels[i, :len(f["input_ids"])] = f["input_ids"]
    return {"input_ids": ids, "labels": labels}


def test_batches_of_different_lengths_are_padded_with_minus_100(tmp_path):
    rows = _varlen_rows()
    model = TinyLM()
    trainer = Trainer(model=model, args=make_args(tmp_path, per_device_eval_batch_size=4),
                      data_collator=pad_per_batch)
    out = trainer.predict(rows)
    assert out.predictions.shape == (10, 9, 64) and out.label_ids.shape == (10, 9)
    for start, width in ((0, 5), (4, 9), (8, 3)):
        stop = min(start + 4, 10)
        batch = pad_per_batch(rows[start:stop])
        with torch.no_grad():
            logits = model(batch["input_ids"])["logits"].numpy()
        np.testing.assert_allclose(out.predictions[start:stop, :width], logits, rtol=1e-6)
        np.testing.assert_array_equal(out.label_ids[start:stop, :width], batch["labels"].numpy())
        # Beyond this batch's width: -100 in predictions and labels alike.
        assert (out.predictions[start:stop, width:] == -100).all()
        assert (out.label_ids[start:stop, width:] == -100).all()
    assert out.metrics["test_loss"] > 0


def test_concat_batches_pads_nested_structures():
    assert concat_batches([]) is None
    a, b = torch.ones(2, 3), torch.zeros(1, 5)
    out = concat_batches([a, b])
    assert out.shape == (3, 5)
    assert (out[:2, :3] == 1).all() and (out[:2, 3:] == -100).all() and (out[2] == 0).all()
    # Three dims: every dim after the first is padded to the max.
    x, y = torch.ones(2, 3, 4), torch.zeros(1, 2, 6)
    out = concat_batches([x, y], pad=-1)
    assert out.shape == (3, 3, 6)
    assert (out[:2, :, 4:] == -1).all() and (out[2, 2:] == -1).all() and (out[2, :2, :] == 0).all()
    # Nested tuples / dicts keep their structure; scalars become 1-d.
    nested = concat_batches([(a, {"k": torch.tensor([1, 2])}), (b, {"k": torch.tensor([3])})])
    assert isinstance(nested, tuple) and nested[0].shape == (3, 5)
    assert nested[1]["k"].tolist() == [1, 2, 3]
    assert concat_batches([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]
    # Same trailing shapes: plain concatenation, dtype kept.
    same = concat_batches([torch.arange(6).view(2, 3), torch.arange(3).view(1, 3)])
    assert same.dtype == torch.long and same.tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert pad_and_concat(None, b) is b
    assert pad_and_concat(a, b).shape == (3, 5)


# -- 7. prediction_loss_only, ignore_keys, label_names ------------------------------------------------


def test_prediction_loss_only_returns_no_predictions(tmp_path):
    rows = lm_rows(12, seed=5)

    def never(pred):
        raise AssertionError("compute_metrics must not be called with prediction_loss_only")

    trainer = Trainer(model=TinyLM(), args=make_args(tmp_path, prediction_loss_only=True), eval_dataset=rows,
                      compute_metrics=never)
    out = trainer.predict(rows)
    assert out.predictions is None and out.label_ids is None
    assert out.metrics["test_loss"] > 0
    assert trainer.eval_peak_device_bytes == 0
    assert "eval_loss" in trainer.evaluate()


def test_ignore_keys_drops_an_output(tmp_path):
    rows = lm_rows(12, seed=6)
    trainer = Trainer(model=TinyLM(extra_output=True), args=make_args(tmp_path))
    both = trainer.predict(rows)
    assert isinstance(both.predictions, tuple) and len(both.predictions) == 2
    assert both.predictions[0].shape == (12, SEQ, 64) and both.predictions[1].shape == (12, SEQ, 16)
    only_logits = trainer.predict(rows, ignore_keys=["hidden"])
    assert isinstance(only_logits.predictions, np.ndarray) and only_logits.predictions.shape == (12, SEQ, 64)
    np.testing.assert_array_equal(only_logits.predictions, both.predictions[0])


def test_label_names_with_a_custom_label_key(tmp_path):
    rows = lm_rows(12, seed=7, label_key="targets")
    received = []

    def compute_metrics(pred):
        received.append(pred)
        return token_accuracy(pred)

    trainer = Trainer(model=TargetsLM(), args=make_args(tmp_path, label_names=["targets"]), eval_dataset=rows,
                      compute_metrics=compute_metrics)
    out = trainer.predict(rows)
    targets = torch.stack([r["targets"] for r in rows]).numpy()
    np.testing.assert_array_equal(out.label_ids, targets)
    assert out.metrics["test_loss"] > 0 and 0 < out.metrics["test_accuracy"] < 1
    np.testing.assert_array_equal(received[0].label_ids, targets)
    # Without label_names the targets are not recognised as labels: no loss, no label_ids.
    plain = Trainer(model=TargetsLM(), args=make_args(tmp_path / "plain")).predict(
        [{"input_ids": r["input_ids"]} for r in rows])
    assert plain.label_ids is None and "test_loss" not in plain.metrics


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
    assert [e[f"eval_{key}"] for e in _evals(trainer)] == SCRIPT
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
    history = [(e["step"], e["eval_a_loss"]) for e in _evals(trainer, "eval_a_loss")]
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
    first, cut = _evals(trainer)
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
    evals = _evals(trainer)
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
    evals = _evals(trainer, "eval_accuracy")
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
    evals = _evals(trainer, "eval_accuracy")
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
    evals = _evals(trainer, "eval_accuracy")
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
