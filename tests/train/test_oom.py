"""Out of memory, recovered in place (train/oom.py): an injected ``torch.OutOfMemoryError`` at
step k halves the micro-batch and doubles the accumulation; the weights equal, bitwise, a run
that trained with that accumulation from step k (same data order, same effective batch), and a
resume after it is bitwise too. An evaluation batch that does not fit is cut for evaluation
only; running out past ``oom_retries`` stops with a checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from workbench import Trainer, TrainerCallback, TrainingArguments
from workbench.data.builtin import load_builtin_data
from workbench.distributed.health import Health
from workbench.train.oom import split_batch


class Tight(nn.Module):
    """An MLP classifier whose forward runs out of memory on batches larger than ``fits``
    once step ``from_step`` is reached (the device filling up as a run goes on)."""

    def __init__(self, fits: int | None = None, from_step: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
        self.fits, self.from_step, self.step = fits, from_step, 0
        self.failures = 0

    def forward(self, x, labels=None):
        if self.training and self.fits is not None and self.step >= self.from_step and x.shape[0] > self.fits:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Steps(TrainerCallback):
    """Tells the model the step it is at (the model cannot see the trainer); stops at ``stop_at``."""

    def __init__(self, model: Tight, stop_at: int | None = None) -> None:
        self.model, self.stop_at = model, stop_at

    def on_step_begin(self, args, state, control, **kwargs):
        self.model.step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def _trainer(out, model: Tight, *, batch: int = 16, accumulation: int = 1, steps: int = 12,
             health: Health | None = None, stop_at: int | None = None, **extra) -> Trainer:
    train, evals = load_builtin_data("random-classification", n_train=512, n_eval=64, in_features=8, num_classes=3,
                                     seed=1)
    callback = Steps(model, stop_at)
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, learning_rate=0.05, save_steps=4,
                             logging_steps=1, report_to="none", disable_tqdm=True, seed=0, **extra)
    return Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=[callback],
                   health=health)


def _run(out, model: Tight, *, resume=None, **options):
    trainer = _trainer(out, model, **options)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_an_oom_halves_the_micro_batch_and_matches_a_run_with_that_accumulation(tmp_path):
    injected = _run(tmp_path / "oom", Tight(fits=8, from_step=4))
    assert injected.model.failures == 1 and injected.state.global_step == 12
    edit = [e for e in injected.workbench_state.live_edits if "micro_batch_split" in e]
    assert len(edit) == 1 and edit[0]["step"] == 4 and "out of memory in forward" in edit[0]["reason"]
    assert "16 -> 8 rows" in edit[0]["reason"] and "1 -> 2" in edit[0]["reason"]
    # The reference: the same run to step 4, then resumed with half the batch and twice the accumulation.
    _run(tmp_path / "ref", Tight(), stop_at=4)
    reference = _run(tmp_path / "ref", Tight(), batch=8, accumulation=2, resume=str(tmp_path / "ref" / "checkpoint-4"))
    for a, b in zip(_weights(injected), _weights(reference)):
        assert torch.equal(a, b)
    losses = [h["loss"] for h in injected.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in reference.state.log_history if "loss" in h]


def test_a_resume_after_the_recovery_keeps_the_cut_and_is_bitwise(tmp_path):
    whole = _run(tmp_path / "whole", Tight(fits=8, from_step=4))
    shutil.copytree(tmp_path / "whole" / "checkpoint-8", tmp_path / "again" / "checkpoint-8")
    resumed = _run(tmp_path / "again", Tight(fits=8, from_step=4), resume=str(tmp_path / "again" / "checkpoint-8"))
    assert resumed.model.failures == 0  # the resumed run cut its batches from the start
    for a, b in zip(_weights(whole), _weights(resumed)):
        assert torch.equal(a, b)


def test_out_of_memory_past_the_retries_stops_with_a_checkpoint(tmp_path, caplog):
    trainer = _run(tmp_path / "out", Tight(fits=1, from_step=2), health=Health(oom_retries=2))
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    assert "again after 2 recoveries (oom_retries = 2)" in caplog.text


def test_split_batch_cuts_tensors_in_order_and_repeats_the_rest():
    batch = {"x": torch.arange(12).reshape(6, 2), "labels": torch.arange(6), "note": "same"}
    halves = split_batch(batch, 2)
    assert [h["labels"].tolist() for h in halves] == [[0, 1, 2], [3, 4, 5]]
    assert all(h["note"] == "same" for h in halves)
    assert torch.equal(torch.cat([h["x"] for h in halves]), batch["x"])


class TightInEval(Tight):
    """Runs out of memory on evaluation batches larger than ``fits`` (training is untouched)."""

    def forward(self, x, labels=None):
        if not self.training and self.fits is not None and x.shape[0] > self.fits:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected, evaluation)")
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_an_oom_in_evaluation_cuts_the_eval_batch_only(tmp_path):
    plain = _run(tmp_path / "plain", Tight(), steps=4, per_device_eval_batch_size=64)
    tight = _run(tmp_path / "tight", TightInEval(fits=16), steps=4, per_device_eval_batch_size=64)
    full, cut = plain.evaluate(), tight.evaluate()
    assert tight.model.failures == 2 and tight._eval_split == 4  # batches of 64 -> 32 (too many) -> 16 rows
    assert cut["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)
    assert tight.args.per_device_train_batch_size == 16 and not [e for e in tight.workbench_state.live_edits
                                                                 if "micro_batch_split" in e]


def test_a_batch_forecast_not_to_fit_is_refused_with_the_figures():
    from workbench.train.memory import forecast_problem

    gib = 2**30
    saved = {"peak": 30 * gib, "static": 10 * gib, "rows": 8, "total": 40 * gib}
    assert forecast_problem(saved, 8) is None and forecast_problem(saved, 11) is None  # 10 + 2.5 x 11 = 37.5 <= 38
    assert forecast_problem(saved, 12) is not None  # 40 GiB > 95% of 40
    line = forecast_problem(saved, 16)
    assert line.startswith("a micro-batch of 16 rows needs about 50.0 GiB (measured: 30.0 GiB peak with 8 rows")
    assert "use at most 11 rows" in line and "\n" not in line
    assert forecast_problem(None, 64) is None  # the CPU keeps no figures: nothing is refused


def test_the_recovery_is_an_edit_event_with_the_memory_figures_every_front_end_reads(tmp_path, sessions):
    from workbench import Session
    from workbench.control.watch import RecordedRun
    from workbench.core.edits import edit_changes
    from workbench.core.event_file import read_events

    trainer = _trainer(tmp_path, Tight(fits=8, from_step=4), steps=8)
    session = Session(trainer)
    sessions.append(session)
    session.start()
    assert session.wait(60) == "finished"
    # events.jsonl: an edit record, as a set() makes, with the figures (a CPU run has the host's).
    edits = [e for e in read_events(tmp_path) if e["event"] == "edit"]
    assert len(edits) == 1 and edits[0]["step"] == 4 and edits[0]["micro_batch_split"] == 2
    assert "16 -> 8 rows" in edits[0]["reason"] and "host memory" in edits[0]["reason"]
    assert edits[0]["memory"]["device"] == "cpu" and edits[0]["memory"]["host_rss"] > 0
    # The Session: its snapshot's edits (dashboard, panel, ctl status) and an "edited" event.
    snap = session.snapshot()
    assert snap.edit_count == 1 and snap.edits[-1]["micro_batch_split"] == 2 and "memory" in snap.edits[-1]
    assert edit_changes(snap.edits[-1]) == {"micro_batch_split": 2}  # the figures and reason are no change
    events, _ = session.events_since(0)
    edited = [e for e in events if e.kind == "edited"]
    assert len(edited) == 1 and edited[0].step == 4 and edited[0].data["micro_batch_split"] == 2
    assert edited[0].data["memory"]["host_rss"] > 0 and "out of memory in forward" in edited[0].data["reason"]
    # watch: a finished run read back from its files shows the same edit.
    assert RecordedRun(tmp_path).snapshot().edits[-1]["micro_batch_split"] == 2
    # Recorded once: the live edits a checkpoint carries (and a resume restores the cut from) hold one.
    assert [e["micro_batch_split"] for e in trainer.workbench_state.live_edits] == [2]


def test_the_forecast_compares_the_pieces_a_recovered_run_trains():
    from workbench.train.oom import OomRecovery

    gib = 2**30
    saved = {"peak": 30 * gib, "static": 10 * gib, "rows": 8, "total": 40 * gib}  # measured with pieces of 8 rows
    recovered = OomRecovery(retries=3)
    recovered.restore([{"step": 4, "micro_batch_split": 2}])
    assert recovered.rows(16) == 8 and recovered.rows(15) == 8  # the largest piece
    assert recovered.forecast(saved, 16) is None  # the same batch size: the same pieces
    line = recovered.forecast(saved, 32)
    assert line.startswith("a micro-batch of 16 rows needs about 50.0 GiB") and "cut in 2" in line
    assert OomRecovery(retries=3).forecast(saved, 16) is not None  # uncut, 16 rows would not fit
    assert recovered.forecast(None, 64) is None  # the CPU keeps no figures: nothing is refused


def test_a_resume_after_a_recovery_forecasts_its_pieces_not_the_whole_batch(tmp_path, monkeypatch):
    import workbench.train.loop as loop

    gib = 2**30
    # What a CUDA device would record at each save: the peak grows with the rows a piece has.
    monkeypatch.setattr(loop, "memory_at_save", lambda model, optimizer, device, rows: {
        "peak": 10 * gib + rows * 2.5 * gib, "static": 10 * gib, "rows": rows, "total": 40 * gib})
    first = _run(tmp_path / "run", Tight(fits=8, from_step=4), steps=8)
    assert first.workbench_state.memory["rows"] == 8  # checkpoint-8 measured pieces of 8 rows
    # The same batch size: the restored cut makes pieces of 8 rows, which fit (not 16, which would not).
    resumed = _run(tmp_path / "run", Tight(fits=8, from_step=4), steps=12,
                   resume=str(tmp_path / "run" / "checkpoint-8"))
    assert resumed.state.global_step == 12 and resumed.model.failures == 0
    # Twice the batch: pieces of 16 rows, refused before a step runs, with the figures.
    with pytest.raises(ValueError, match=r"resuming from checkpoint-8: a micro-batch of 16 rows .* cut in 2"):
        _run(tmp_path / "run", Tight(), batch=32, steps=16, resume=str(tmp_path / "run" / "checkpoint-8"))
