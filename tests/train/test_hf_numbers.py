"""The numbers an HF user sees, side by side with transformers' own Trainer (issue 23, items 1-3).

1. Batches that are a ``Mapping`` but not a ``dict`` (HF's collators return ``BatchEncoding``)
   are batches everywhere: evaluation sample counts and loss weights, metric inputs, the
   target count of accumulated steps, progress, inspection, the guard's sample ids.
2. transformers' models are recognised by kind as transformers decides (``GPT2LMHeadModel``
   is a causal LM), and k accumulated micro-batches give the loss and update of one
   k-times-larger batch for a causal LM, a masked LM and a classifier.
3. A seeded run draws the global random numbers HF's draws (its loaders' base seeds), so
   dropout and random masking see the same numbers: per-step losses equal HF's bitwise,
   across epochs, evaluations and a resume.

Everything runs on the CPU from tiny configs (hidden 32, 2 layers) and a tokenizer built here,
so where HF's rule and workbench's agree the numbers are compared bitwise. Tolerances are
used only where the same sums are taken in another order (a batch of 8 against two of 4:
different matmul shapes and padding) and say so where they are.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="the side-by-side runs need transformers (test extra)")

from workbench import Guard, Session, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from workbench.core.event_file import read_events  # noqa: E402
from workbench.models.kinds import loss_uses_item_count, model_kind  # noqa: E402
from workbench.session.inspection import can_sample, inspect_model, sample_text  # noqa: E402

from support import StopAt, assert_same_weights, poll_until, weights  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
BOTH = {"hf": (transformers.Trainer, transformers.TrainingArguments), "wb": (Trainer, TrainingArguments)}


# -- data, models, runs -------------------------------------------------------------------------


def tokenizer() -> "transformers.PreTrainedTokenizerFast":
    """A word-level tokenizer over WORDS, built here (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


TOK = tokenizer()


def texts(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 12))) for _ in range(n)]


def classified(n: int, seed: int) -> list[dict]:
    """Tokenized rows of different lengths with a label each (a collator pads them)."""
    return [{**TOK(t), "labels": i % 2} for i, t in enumerate(texts(n, seed))]


def tokenized(n: int, seed: int) -> list[dict]:
    return [{"input_ids": TOK(t)["input_ids"]} for t in texts(n, seed)]


def bert_config(dropout: float = 0.1, **overrides) -> "transformers.BertConfig":
    options = dict(vocab_size=len(TOK), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
                   attention_probs_dropout_prob=dropout)
    options.update(overrides)
    return transformers.BertConfig(**options)


def gpt2_config() -> "transformers.GPT2Config":
    return transformers.GPT2Config(vocab_size=len(TOK), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def built(cls, config) -> nn.Module:
    torch.manual_seed(0)
    return cls(config)


def options(out, **overrides) -> dict:
    base = dict(output_dir=str(out), report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                use_cpu=True, seed=0, learning_rate=1e-3)
    base.update(overrides)
    return base


def side_by_side(make_model, args: dict, tmp_path, train: bool = True, **trainer_kwargs) -> dict:
    """The same model, data and arguments under each Trainer (trained unless ``train`` is False)."""
    made = {}
    for name, (trainer_cls, args_cls) in BOTH.items():
        trainer = trainer_cls(model=make_model(), args=args_cls(**options(tmp_path / name, **args)),
                              **trainer_kwargs)
        if train:
            trainer.train()
        made[name] = trainer
    return made


def logged(trainer, key: str = "loss") -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e]


# -- 1. Mapping batches: evaluation and prediction ----------------------------------------------


def test_batch_encoding_batches_evaluate_and_predict_as_hf(tmp_path):
    """A BERT classifier, DataCollatorWithPadding (BatchEncoding batches), 70 eval samples at
    eval batch 16: the sample count (70, not 5 batches), the per-sample loss weights, the
    metrics' ``inputs`` and the predictions equal HF's bitwise. Dropout 0.1 in training, two
    epochs with evaluations between: item 3 keeps the trained weights bitwise equal."""
    collator = transformers.DataCollatorWithPadding(TOK)
    assert type(collator(classified(2, 0))).__name__ == "BatchEncoding"  # the premise: not a dict
    seen: dict[str, list] = {"hf": [], "wb": []}

    def metrics_for(name):
        def compute(pred):
            seen[name].append(pred.inputs)
            return {"rows": float(len(pred.label_ids))}
        return compute

    made = {}
    for name, (trainer_cls, args_cls) in BOTH.items():
        args = args_cls(**options(tmp_path / name, num_train_epochs=2, per_device_train_batch_size=4,
                                  per_device_eval_batch_size=16, eval_strategy="steps", eval_steps=4,
                                  include_for_metrics=["inputs"]))
        made[name] = trainer_cls(model=built(transformers.BertForSequenceClassification, bert_config(num_labels=2)),
                                 args=args, train_dataset=classified(24, 0), eval_dataset=classified(70, 1),
                                 data_collator=collator, compute_metrics=metrics_for(name))
        made[name].train()
    hf, wb = made["hf"], made["wb"]
    assert len(logged(wb)) == 12 and logged(wb) == logged(hf)
    assert len(logged(wb, "eval_loss")) == 3 and logged(wb, "eval_loss") == logged(hf, "eval_loss")
    assert_same_weights(weights(hf), weights(wb))

    metrics = {name: t.evaluate() for name, t in made.items()}
    assert metrics["wb"]["eval_loss"] == metrics["hf"]["eval_loss"]
    for m in metrics.values():  # throughput counts samples and batches (5 of them), not batches twice
        assert m["eval_rows"] == 70
        assert m["eval_samples_per_second"] * m["eval_runtime"] == pytest.approx(70, rel=0.02)
        assert m["eval_steps_per_second"] * m["eval_runtime"] == pytest.approx(5, rel=0.02)
    for name, t in made.items():
        loop = t.evaluation_loop(t.get_eval_dataloader(), "Evaluation")
        assert loop.num_samples == 70, name
    assert all(x is not None for x in seen["wb"]) and len(seen["wb"]) == len(seen["hf"]) == 5
    for ours, theirs in zip(seen["wb"], seen["hf"]):
        assert ours.shape == theirs.shape and ours.shape[0] == 70 and np.array_equal(ours, theirs)

    test = classified(21, 2)
    predicted = {name: t.predict(test) for name, t in made.items()}
    assert np.array_equal(predicted["wb"].predictions, predicted["hf"].predictions)
    assert np.array_equal(predicted["wb"].label_ids, predicted["hf"].label_ids)
    assert predicted["wb"].metrics["test_loss"] == predicted["hf"].metrics["test_loss"]
    m = predicted["wb"].metrics
    assert m["test_samples_per_second"] * m["test_runtime"] == pytest.approx(21, rel=0.02)


# -- 3. the same random numbers as HF -----------------------------------------------------------


def test_masked_lm_losses_equal_hf_with_dropout_and_random_masking(tmp_path):
    """BERT MLM, dropout 0.1, DataCollatorForLanguageModeling drawing its masks from the global
    RNG, two epochs with evaluations (whose masks are drawn too): every train and eval loss
    equals HF's bitwise, and so do the final weights."""
    made = side_by_side(lambda: built(transformers.BertForMaskedLM, bert_config()),
                        dict(num_train_epochs=2, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             eval_strategy="steps", eval_steps=3),
                        tmp_path, train_dataset=tokenized(40, 3), eval_dataset=tokenized(20, 4),
                        data_collator=transformers.DataCollatorForLanguageModeling(TOK, mlm_probability=0.3))
    hf, wb = made["hf"], made["wb"]
    assert len(logged(wb)) == 10 and logged(wb) == logged(hf)
    assert len(logged(wb, "eval_loss")) == 4 and logged(wb, "eval_loss") == logged(hf, "eval_loss")
    assert_same_weights(weights(hf), weights(wb))


@pytest.mark.parametrize("stop_at", [3, 6], ids=["mid-epoch", "epoch-boundary"])
def test_a_resumed_run_keeps_hf_numbers_bitwise(tmp_path, stop_at):
    """A classifier with dropout 0.1, evaluations every 4 steps, 2 epochs of 6 steps: a run
    stopped at ``stop_at`` (with a checkpoint) and resumed ends bitwise where the
    uninterrupted run ends, and that is HF's uninterrupted run. The epoch's draw is consumed
    once: a run resumed mid-epoch took its RNG state from after it."""
    collator = transformers.DataCollatorWithPadding(TOK)
    args = dict(num_train_epochs=2, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=4,
                per_device_eval_batch_size=8)
    data = dict(train_dataset=classified(24, 0), eval_dataset=classified(10, 1), data_collator=collator)
    make = lambda: built(transformers.BertForSequenceClassification, bert_config(num_labels=2))  # noqa: E731
    made = side_by_side(make, args, tmp_path, **data)
    out = tmp_path / "resumed"
    first = Trainer(model=make(), args=TrainingArguments(**options(out, **args, save_strategy="steps", save_steps=100)),
                    callbacks=[StopAt(stop_at)], **data)
    first.train()
    assert first.state.global_step == stop_at
    second = Trainer(model=make(), args=TrainingArguments(**options(out, **args, save_strategy="steps", save_steps=100)),
                     **data)
    second.train(resume_from_checkpoint=True)
    assert len(logged(made["wb"])) == 12 and logged(made["wb"]) == logged(made["hf"])
    # The resumed state carries the first run's log history, as HF's does.
    assert logged(second)[:stop_at] == logged(first)
    assert logged(second) == logged(made["wb"])
    assert logged(second, "eval_loss") == logged(made["wb"], "eval_loss")
    assert_same_weights(weights(second), weights(made["hf"]))


class StopBeforeStep(TrainerCallback):
    """Stop (with a checkpoint) as step ``n`` + 1 begins: its micro-batches are fetched and
    collated, not trained (a pause's or a signal's stop at the start of a step)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_save = control.should_training_stop = True


@pytest.mark.parametrize("stop", ["after-eval", "before-step"])
def test_a_run_resumed_past_randomly_masked_batches_collated_ahead_is_bitwise(tmp_path, stop):
    """Random masking drawn from the global RNG, dropout, 2 accumulated micro-batches and an
    evaluation (masked too) at the stop: Accelerate's loader collates a batch ahead, and a stop
    at a step's start has collated its micro-batches, all before the checkpoint's RNG state.
    The resumed run draws those batches' masks from the streams they were drawn from: every
    loss, the evaluations and the final weights equal the uninterrupted run's bitwise."""
    collator = transformers.DataCollatorForLanguageModeling(TOK, mlm_probability=0.3)
    args = dict(max_steps=8, per_device_train_batch_size=4, gradient_accumulation_steps=2, eval_strategy="steps",
                eval_steps=3, per_device_eval_batch_size=8)
    data = dict(train_dataset=tokenized(80, 3), eval_dataset=tokenized(16, 4), data_collator=collator)
    make = lambda: built(transformers.BertForMaskedLM, bert_config())  # noqa: E731
    full = Trainer(model=make(), args=TrainingArguments(**options(tmp_path / "full", **args)), **data)
    full.train()
    out = tmp_path / "cut"
    saving = options(out, **args, save_strategy="steps", save_steps=100)
    callback = StopAt(3) if stop == "after-eval" else StopBeforeStep(4)
    Trainer(model=make(), args=TrainingArguments(**saving), callbacks=[callback], **data).train()
    resumed = Trainer(model=make(), args=TrainingArguments(**saving), **data)
    resumed.train(resume_from_checkpoint=True)
    assert len(logged(full)) == 8 and logged(resumed) == logged(full)
    assert logged(resumed, "eval_loss") == logged(full, "eval_loss")
    assert_same_weights(weights(resumed), weights(full))


# -- 2. model kinds and accumulation ---------------------------------------------------------------


class LMWrapper(nn.Module):
    """A user's module around a transformers causal LM: the config names the architecture."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = transformers.GPT2LMHeadModel(gpt2_config())
        self.config = self.inner.config
        self.config.architectures = ["GPT2LMHeadModel"]

    def forward(self, input_ids, labels=None):
        return self.inner(input_ids=input_ids, labels=labels)


class MyGPT(transformers.GPT2LMHeadModel):
    """A subclass: transformers gives it no loss_type (its name carries none)."""


def kinds_cases() -> dict[str, nn.Module]:
    return {
        "GPT2LMHeadModel": transformers.GPT2LMHeadModel(gpt2_config()),
        "BertLMHeadModel": transformers.BertLMHeadModel(bert_config(is_decoder=True)),
        "LlamaForCausalLM": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2)),
        "BertForMaskedLM": transformers.BertForMaskedLM(bert_config()),
        "BertForSequenceClassification": transformers.BertForSequenceClassification(bert_config(num_labels=2)),
        "BertForTokenClassification": transformers.BertForTokenClassification(bert_config(num_labels=3)),
        "MyGPT": MyGPT(gpt2_config()),
        "LMWrapper": LMWrapper(),
    }


def test_model_kinds_as_transformers_decides():
    """transformers' Trainer treats a model as a causal LM (label smoothing shifts its labels)
    when its class is in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; its loss_type, where set, names
    the kind. workbench decides alike, for subclasses and wrappers too."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    expected = {"GPT2LMHeadModel": "ForCausalLM", "BertLMHeadModel": "ForCausalLM", "LlamaForCausalLM": "ForCausalLM",
                "BertForMaskedLM": "ForMaskedLM", "BertForSequenceClassification": "ForSequenceClassification",
                "BertForTokenClassification": "ForTokenClassification", "MyGPT": "ForCausalLM",
                "LMWrapper": "ForCausalLM"}
    for name, model in kinds_cases().items():
        kind = model_kind(model)
        assert kind == expected[name], name
        if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            assert kind == "ForCausalLM", name
        if getattr(model, "loss_type", None):
            assert kind == model.loss_type, name

    class Scorer(nn.Module):  # not transformers': its config's problem_type says classifier
        config = {"problem_type": "single_label_classification"}

        def forward(self, x):
            return x

    assert model_kind(Scorer()) == "ForSequenceClassification"
    assert model_kind(nn.Linear(2, 2)) is None


def test_a_transformers_causal_lm_can_be_sampled_from(tmp_path):
    """The inspect views offer text samples for causal LMs: GPT2LMHeadModel is one."""
    trainer = Trainer(model=built(transformers.GPT2LMHeadModel, gpt2_config()),
                      args=TrainingArguments(**options(tmp_path)), processing_class=TOK)
    assert can_sample(trainer)
    assert isinstance(sample_text(trainer, "w1 w2", max_new_tokens=4), str)
    classifier = Trainer(model=built(transformers.BertForSequenceClassification, bert_config(num_labels=2)),
                         args=TrainingArguments(**options(tmp_path)), processing_class=TOK)
    assert not can_sample(classifier)


def test_which_models_divide_their_loss_by_the_item_count():
    """Checked on the models themselves: a forward given ``num_items_in_batch=1`` returns a
    summed loss where its loss honours the count, the same mean where it ignores it."""
    ids = torch.tensor([TOK("w1 w2 w3 w4 w5")["input_ids"]] * 2)
    for name, model in kinds_cases().items():
        if name == "LMWrapper":
            continue
        labels = torch.tensor([1, 0]) if name == "BertForSequenceClassification" else ids.clamp(max=2) \
            if name == "BertForTokenClassification" else ids
        model.eval()
        with torch.no_grad():
            mean = model(input_ids=ids, labels=labels).loss
            counted = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(1)).loss
        assert loss_uses_item_count(model) == (not torch.allclose(mean, counted)), name


def micro_batches_equal_one_batch(tmp_path, make_model, rows, collator, label: str) -> dict:
    """Three steps of batch 8 x accumulation 1 against batch 4 x accumulation 2 (sequential
    data: each step trains on the same 8 rows), no dropout, under workbench and under HF.
    Plain SGD: its update is the gradient itself, where Adam's normalization would magnify
    rounding in gradients near zero."""
    runs = {}
    for name, (trainer_cls, args_cls) in BOTH.items():
        for batch, accumulation in ((8, 1), (4, 2)):
            args = args_cls(**options(tmp_path / f"{label}-{name}-{batch}", max_steps=3, learning_rate=0.5,
                                      optim="sgd", per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                                      train_sampling_strategy="sequential"))
            trainer = trainer_cls(model=make_model(), args=args, train_dataset=rows, data_collator=collator)
            trainer.train()
            runs[name, accumulation] = (logged(trainer), weights(trainer))
    return runs


def assert_invariant(runs: dict) -> None:
    """Losses and weights of the two batchings agree to float32 rounding (rel 1e-5, abs 1e-6):
    the same sums, taken over other matmul shapes and paddings, round differently."""
    (one, w_one), (two, w_two) = runs["wb", 1], runs["wb", 2]
    assert len(one) == len(two) == 3 and two == pytest.approx(one, rel=1e-5)
    for name in w_one:
        assert torch.allclose(w_one[name], w_two[name], rtol=1e-5, atol=1e-6), name


def test_accumulation_invariance_of_a_causal_lm(tmp_path):
    """GPT2 (its class name carries no loss-mapping name): counted as a causal LM, so batch 8
    x 1 and 4 x 2 agree (before, the 4 x 2 count took each row's first label too: 1e-3
    apart). HF is invariant too, but it divides by the unshifted labels (its loss_type is
    None), so its losses are below the model's mean (README: causal-LM token counts)."""
    collator = transformers.DataCollatorForLanguageModeling(TOK, mlm=False)
    runs = micro_batches_equal_one_batch(tmp_path, lambda: built(transformers.GPT2LMHeadModel, gpt2_config()),
                                         tokenized(24, 5), collator, "gpt2")
    assert_invariant(runs)
    (hf_one, _), (wb_one, _) = runs["hf", 1], runs["wb", 1]
    assert all(h < w for h, w in zip(hf_one, wb_one))  # HF's denominator counts each row's first label too


def test_accumulation_invariance_of_a_masked_lm(tmp_path):
    """BERT MLM: its loss is a CrossEntropyLoss mean that ignores num_items_in_batch, so
    workbench computes it from the logits over the accumulated batch (HF: each micro-batch's
    mean, not divided by the accumulation steps: k times the loss and gradient). The masks are
    drawn once beforehand by DataCollatorForLanguageModeling (a batch of 8 and two of 4 would
    draw other masks) and padded with DataCollatorForTokenClassification."""
    masker = transformers.DataCollatorForLanguageModeling(TOK, mlm_probability=0.3)
    torch.manual_seed(18)
    masked = masker(tokenized(24, 6))
    rows = []
    for ids, labels, mask in zip(masked["input_ids"], masked["labels"], masked["attention_mask"]):
        n = int(mask.sum())
        rows.append({"input_ids": ids[:n].tolist(), "labels": labels[:n].tolist()})
    counts = [sum(v != -100 for v in r["labels"]) for r in rows]
    # The premise: each step's two micro-batches hold different numbers of masked tokens, so
    # the mean of their means is not the step's mean.
    assert all(sum(counts[s:s + 4]) != sum(counts[s + 4:s + 8]) for s in (0, 8, 16))
    runs = micro_batches_equal_one_batch(tmp_path, lambda: built(transformers.BertForMaskedLM, bert_config(0.0)),
                                         rows, transformers.DataCollatorForTokenClassification(TOK), "mlm")
    assert_invariant(runs)
    assert runs["wb", 1][0] == runs["hf", 1][0]  # without accumulation: the model's own loss, as HF


def test_accumulation_invariance_of_a_classifier(tmp_path):
    """BertForSequenceClassification with DataCollatorWithPadding: workbench's 4 x 2 equals its
    8 x 1 (HF's 4 x 2 logs twice the loss: it neither divides nor normalizes)."""
    runs = micro_batches_equal_one_batch(
        tmp_path, lambda: built(transformers.BertForSequenceClassification, bert_config(0.0, num_labels=2)),
        classified(24, 0), transformers.DataCollatorWithPadding(TOK), "cls")
    assert_invariant(runs)
    assert runs["wb", 1][0] == runs["hf", 1][0]


# -- 1. Mapping batches: the guard and the session ------------------------------------------------


class Poisonable(nn.Module):
    """Bag-of-words classifier whose per-row loss is multiplied by ``mult`` (NaN poisons a row)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.EmbeddingBag(len(TOK), 8, mode="sum")
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask=None, labels=None, mult=None, idx=None):
        logits = self.head(self.embed(input_ids, per_sample_weights=attention_mask.float()))
        loss = (nn.functional.cross_entropy(logits, labels, reduction="none") * mult).mean()
        return {"loss": loss, "logits": logits}


class Order(TrainerCallback):
    """Each step's row ids and batch type, read from the batch the step trains on."""

    def __init__(self) -> None:
        self.trainer, self.steps, self.types = None, [], set()

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(self.trainer.last_inputs["idx"].tolist())
        self.types.add(type(self.trainer.last_inputs).__name__)


def test_guard_names_the_rows_of_a_bad_step_of_batch_encoding_batches(tmp_path):
    def rows(poisoned=None):
        return [{**TOK(t), "labels": i % 2, "idx": i, "mult": float("nan") if i == poisoned else 1.0}
                for i, t in enumerate(texts(32, 0))]

    def run(out, data):
        order = Order()
        trainer = Trainer(model=Poisonable(), args=TrainingArguments(**options(out, max_steps=8, seed=3,
                                                                               per_device_train_batch_size=4)),
                          train_dataset=data, data_collator=transformers.DataCollatorWithPadding(TOK),
                          callbacks=[order], guard=Guard(nonfinite="skip"))
        order.trainer = trainer
        trainer.train()
        return order

    clean = run(tmp_path / "clean", rows())
    assert clean.types == {"BatchEncoding"}
    bad = clean.steps[4][1]  # a row of step 5
    run(tmp_path / "bad", rows(poisoned=bad))
    events = [e for e in read_events(tmp_path / "bad") if e["event"] == "guard"]
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(5, "nonfinite", "skip")]
    assert events[0]["samples"] == clean.steps[4]


class PauseAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step, self.session, self.batch = step, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.batch = self.session.last_batch  # the last batch the live tokens/s has counted
            self.session.pause()


def test_session_inspects_and_measures_batch_encoding_batches(tmp_path):
    pause = PauseAt(3)
    trainer = Trainer(model=built(transformers.BertForSequenceClassification, bert_config(num_labels=2)),
                      args=TrainingArguments(**options(tmp_path, max_steps=6, per_device_train_batch_size=4)),
                      train_dataset=classified(24, 0), data_collator=transformers.DataCollatorWithPadding(TOK),
                      callbacks=[pause])
    session = Session(trainer)
    pause.session = session
    session.start()
    try:
        assert poll_until(lambda: session.status == "paused", 60, every=0.01)
        batch = session.last_batch
        assert type(batch).__name__ == "BatchEncoding"
        report = session.inspect()
        assert report["batch_shapes"] == {k: tuple(v.shape) for k, v in batch.items()}
        assert set(report["batch_shapes"]) == {"input_ids", "attention_mask", "labels"}
        assert inspect_model(trainer)["batch_shapes"] == report["batch_shapes"]
        snap = session.snapshot()
        assert snap.tokens_per_second is not None and snap.tokens_per_second > 0
        # Non-padding tokens (train/throughput.py), as train_tokens_per_second counts them: not
        # samples x the padded length.
        counted = pause.batch["attention_mask"]
        assert counted.sum() < counted.numel()
        assert snap.tokens_per_second == pytest.approx(snap.samples_per_second * counted.sum().item() / counted.shape[0])
    finally:
        session.resume()
        assert session.wait(60) == "finished"
