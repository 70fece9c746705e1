"""Evaluation as the reference specifies (issue 3): memory-bounded accumulation, batched
metrics, include_for_metrics, dynamic shapes, precision modes, best-metric tracking, stop
during evaluation, and the reference's own code examples.

Everything runs real models on the CPU, mostly support.eval_lm's language model, whose
predictions mean something without training. Precision modes, the best metric, several eval
sets, stopping during evaluation and the reference's examples are in test_evaluation_runs.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench import EvalPrediction, Trainer
from workbench.train.evaluation import concat_batches, pad_and_concat

from support.eval_lm import SEQ, TargetsLM, TinyLM, argmax, batch_bytes, lm_rows, make_args, token_accuracy

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
