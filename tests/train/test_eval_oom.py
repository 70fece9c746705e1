"""Out of memory in evaluation (train/eval_oom.py): the evaluation batch is computed again in
parts joined before the gathers, for evaluation only; the cut is a warning and an
``eval_oom`` record, never a live edit. With several ranks the flags that make a cut every
rank's are read once an evaluation (distributed/oom_flags.py ``EvalOomFlags``); the 2-rank
run is tests/distributed/test_eval_oom_ranks_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.utils import DistributedType
from torch import nn

from workbench import Trainer, TrainingArguments
from workbench.core.event_file import read_events
from workbench.data.builtin import load_builtin_data
from workbench.distributed.oom_flags import EvalOomFlags
from workbench.train.eval_oom import EvalCuts


class TightInEval(nn.Module):
    """An MLP classifier whose evaluation forward runs out of memory on batches larger than
    ``fits`` (training is untouched); it notes the rows of every evaluation forward."""

    def __init__(self, fits: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        self.fits, self.failures, self.rows = fits, 0, []

    def forward(self, x, labels=None):
        if not self.training:
            self.rows.append(x.shape[0])
            if self.fits is not None and x.shape[0] > self.fits:
                self.failures += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected, evaluation)")
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def metrics(pred) -> dict[str, float]:
    """Accuracy, and the rows and their order: a row gathered twice, dropped or moved changes them."""
    labels = np.asarray(pred.label_ids)
    return {"accuracy": float((np.argmax(pred.predictions, -1) == labels).mean()), "rows": float(labels.size),
            "order": float((labels * np.arange(1, labels.size + 1)).sum())}


def _trained(out, model: TightInEval) -> Trainer:
    # 70 evaluation rows in batches of 64: a full batch and a short one.
    train, evals = load_builtin_data("random-classification", n_train=256, n_eval=70, in_features=8, num_classes=3,
                                     seed=1)
    args = TrainingArguments(str(out), max_steps=4, per_device_train_batch_size=16, per_device_eval_batch_size=64,
                             learning_rate=0.05, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, compute_metrics=metrics)
    trainer.train()
    return trainer


def test_an_eval_cut_gives_the_uncut_metrics_and_is_recorded_not_edited(tmp_path):
    plain = _trained(tmp_path / "plain", TightInEval())
    tight = _trained(tmp_path / "tight", TightInEval(fits=16))
    full, cut = plain.evaluate(), tight.evaluate()
    # 64 rows -> 32 (still too many) -> 16; the short batch of 6 is cut in 4 pieces of 1-2 rows.
    assert tight.model.failures == 2 and tight._eval_split == 4
    assert tight.model.rows[:6] == [64, 32, 16, 16, 16, 16] and sum(tight.model.rows[6:]) == 6
    assert cut["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    assert cut["eval_accuracy"] == full["eval_accuracy"]
    assert cut["eval_rows"] == full["eval_rows"] == 70 and cut["eval_order"] == full["eval_order"]
    # Recorded: an eval_oom record with the figures, no edit (nothing of the training changed).
    events = read_events(tmp_path / "tight")
    records = [e for e in events if e["event"] == "eval_oom"]
    assert len(records) == 1 and records[0]["split"] == 4 and records[0]["step"] == 4
    assert "eval batch 64 -> 16 rows" in records[0]["reason"] and "the training batch is unchanged" in records[0]["reason"]
    assert records[0]["cuts"][0]["rank"] == 0 and records[0]["cuts"][0]["memory"]["host_rss"] > 0
    assert not [e for e in events if e["event"] == "edit"] and not tight.workbench_state.live_edits
    assert tight.args.per_device_train_batch_size == 16 and tight.args.per_device_eval_batch_size == 64
    # The run's later evaluations keep the cut: no failure, no new record.
    again = tight.evaluate()
    assert tight.model.failures == 2 and again["eval_loss"] == cut["eval_loss"]
    assert len([e for e in read_events(tmp_path / "tight") if e["event"] == "eval_oom"]) == 1


def test_an_eval_batch_of_one_row_that_does_not_fit_says_what_to_do(tmp_path):
    tight = _trained(tmp_path, TightInEval())
    tight.model.fits = 0
    with pytest.raises(torch.OutOfMemoryError, match=r"batches of 1 row\(s\): nothing left to cut"):
        tight.evaluate()


def test_the_flags_of_one_evaluation_reach_every_rank_and_no_other():
    store = torch.distributed.HashStore()
    rank0, rank1 = EvalOomFlags(store, 0, 2), EvalOomFlags(store, 1, 2)
    assert rank0.read(7) == [] and rank1.read(7) == []
    rank1.raise_flag(7, {"split": 2, "reason": "r"})
    rank1.raise_flag(7, {"split": 4, "reason": "r"})  # cut again: the last cut stands
    assert rank0.read(7) == rank1.read(7) == [{"split": 4, "reason": "r", "rank": 1}]
    assert rank0.read(8) == []  # the next evaluation starts clean


def _cuts_on_rank_1_of_2(distributed_type) -> EvalCuts:
    """The policy of rank 1 of 2 whose every evaluation forward runs out of memory."""
    def prediction_step(model, inputs, loss_only, ignore_keys=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2, process_index=1, device=torch.device("cpu"),
                                                          distributed_type=distributed_type),
                              prediction_step=prediction_step)
    return EvalCuts(trainer)


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_sharded_ranks_cannot_redo_a_batch_alone_and_say_so(kind):
    cuts = _cuts_on_rank_1_of_2(kind)
    with pytest.raises(torch.OutOfMemoryError, match=r"on rank 1, not recoverable in place \(FSDP and DeepSpeed"):
        cuts.predict(nn.Linear(8, 3), {"x": torch.zeros(8, 8)}, False, None)


def test_a_session_shows_the_eval_cut_as_it_happens(tmp_path, sessions):
    """Through a Session the cut is an event of its own, worded for the event log (the
    dashboard, the panel and attach show it), not only a record in events.jsonl."""
    from workbench.session.local import Session
    from workbench.widgets.view import describe_event

    from support.sessions import finish

    train, evals = load_builtin_data("random-classification", n_train=256, n_eval=70, in_features=8, num_classes=3,
                                     seed=1)
    args = TrainingArguments(str(tmp_path), max_steps=4, per_device_train_batch_size=16, per_device_eval_batch_size=64,
                             eval_strategy="steps", eval_steps=4, save_strategy="no", report_to="none",
                             disable_tqdm=True, seed=0)
    session = Session(Trainer(model=TightInEval(fits=16), args=args, train_dataset=train, eval_dataset=evals))
    sessions.append(session.start())
    assert finish(session) == "finished"
    cuts = [e for e in session.events_since(0)[0] if e.kind == "eval_oom"]
    assert len(cuts) == 1 and cuts[0].data["split"] == 4
    level, text = describe_event("eval_oom", cuts[0].step, cuts[0].data)
    assert level == "warn" and text.startswith("step 4: out of memory in evaluation: eval batch 64 -> 16 rows")
