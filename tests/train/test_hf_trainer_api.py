"""The HF Trainer surface scripts use, side by side with transformers' Trainer (issue 23,
items 6, 9, 10, 11, 12).

A small BERT classifier built from a config (no download), sequential data and no dropout:
both Trainers take bitwise the same steps on CPU, so what each reports can be compared
exactly: the logged learning rates, total_flos, the files save_metrics / save_state /
create_model_card write, early stopping with transformers' own callback, the warnings' logger
names and wording, and the state after a resume. The transformers-side parts skip where it is
not installed; the workbench-only parts (state files, resume by name, the CLI) always run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from workbench import EarlyStoppingCallback, ExportableState, Trainer, TrainerCallback, TrainingArguments
from workbench.checkpoint.store import CheckpointStore
from workbench.core.state import TrainerState, WorkbenchState
from workbench.models import MLPClassifier
from workbench.train.callbacks import DefaultFlowCallback, PrinterCallback

from support import REPO, StopAt, hf_logs, tiny_bert, token_rows

try:
    import transformers
except ImportError:  # the test extra installs it; without it only workbench's side runs
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed (the test extra has it)")
OPTIONS = dict(max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=8, learning_rate=1e-2,
               warmup_steps=2, lr_scheduler_type="linear", report_to="none", save_strategy="steps", save_steps=3,
               logging_steps=1, eval_strategy="steps", eval_steps=3, use_cpu=True, seed=0,
               train_sampling_strategy="sequential", disable_tqdm=True)
TIMING = re.compile(r"_runtime$|_per_second$")


bert, rows = tiny_bert, token_rows


def pair(tmp_path: Path, callbacks=(), **overrides: Any):
    """The same run set up in transformers' Trainer and in workbench's (only the classes differ)."""
    options = {**OPTIONS, **overrides}
    made = []
    for family, trainer_cls, args_cls in (("hf", transformers.Trainer, transformers.TrainingArguments),
                                          ("wb", Trainer, TrainingArguments)):
        made.append(trainer_cls(model=bert(), args=args_cls(str(tmp_path / family), **options),
                                train_dataset=rows(), eval_dataset=rows(16, seed=2),
                                callbacks=[cb() if callable(cb) and not isinstance(cb, type) else cb
                                           for cb in callbacks]))
    return made


def untimed(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if not TIMING.search(k)} for e in entries]


def close(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``untimed``, with evaluation losses compared to 1e-6: the two Trainers average a set's
    batch losses in another order (the training numbers are compared exactly)."""
    return [{k: pytest.approx(v, rel=1e-6) if k.startswith("eval_") else v for k, v in e.items()}
            for e in untimed(entries)]


# -- item 6: the learning rate HF logs, epoch in metrics, total_flos --------------------------------------


@needs_hf
def test_logged_learning_rate_and_metrics_match_transformers(tmp_path):
    hf, wb = pair(tmp_path)
    hf_out, wb_out = hf.train(), wb.train()
    hf_rates = [e["learning_rate"] for e in hf.state.log_history if "learning_rate" in e]
    wb_rates = [e["learning_rate"] for e in wb.state.log_history if "learning_rate" in e]
    # Linear warmup over 2 steps then decay: each log carries the rate its step used.
    assert hf_rates == wb_rates == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025])
    assert [e["loss"] for e in hf.state.log_history if "loss" in e] == \
           [e["loss"] for e in wb.state.log_history if "loss" in e]  # the premise: the same steps
    # train() metrics: HF's keys, the epoch among them, equal where nothing is timed.
    assert set(wb_out.metrics) == set(hf_out.metrics) and "epoch" in wb_out.metrics
    assert untimed([wb_out.metrics]) == untimed([hf_out.metrics])
    hf_eval, wb_eval = hf.evaluate(), wb.evaluate()
    assert set(wb_eval) == set(hf_eval) and wb_eval["epoch"] == hf_eval["epoch"] == 0.6
    assert untimed(wb.state.log_history) == close(hf.state.log_history)


@needs_hf
def test_total_flos_is_hf_s_count_saved_and_resumed(tmp_path):
    hf, wb = pair(tmp_path)
    hf.train()
    wb.train()
    assert wb.state.total_flos > 0 and wb.state.total_flos == hf.state.total_flos
    for step in (3, 6):  # stored at saves: each checkpoint's trainer_state.json holds the count so far
        saved = [json.loads((tmp_path / f / f"checkpoint-{step}" / "trainer_state.json").read_text())["total_flos"]
                 for f in ("hf", "wb")]
        assert saved[0] == saved[1] > 0
    resumed = Trainer(model=bert(), args=TrainingArguments(str(tmp_path / "wb"), **OPTIONS), train_dataset=rows(),
                      eval_dataset=rows(16, seed=2))
    resumed.train(resume_from_checkpoint=str(tmp_path / "wb" / "checkpoint-3"))
    assert resumed.state.total_flos == wb.state.total_flos
    # One micro-batch of 4 x 8 tokens: 6 x tokens x non-embedding parameters, HF's estimate.
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    assert wb.floating_point_ops(batch) == hf.floating_point_ops(batch) == \
           6 * 32 * wb.model.num_parameters(exclude_embeddings=True)


def test_total_flos_of_a_model_without_a_count_is_zero_and_an_mlp_counts_its_own(tmp_path):
    data = [{"x": torch.randn(8), "labels": torch.tensor(i % 3)} for i in range(16)]
    plain = torch.nn.Linear(8, 3)
    trainer = Trainer(model=MLPClassifier(8, 3), args=TrainingArguments(str(tmp_path), max_steps=2, report_to="none",
                                                                        disable_tqdm=True, save_strategy="no"),
                      train_dataset=data)
    trainer.train()
    assert trainer.state.total_flos == 2 * 6 * 8 * trainer.model.num_parameters()  # 2 steps of 8 rows
    trainer.model = plain
    assert trainer.floating_point_ops({"x": torch.randn(2, 8)}) == 0


@needs_hf
def test_save_metrics_save_state_and_model_card_write_hf_s_files(tmp_path, capsys):
    hf, wb = pair(tmp_path)
    written = {}
    for name, trainer in (("hf", hf), ("wb", wb)):
        metrics = trainer.train().metrics
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_metrics("eval", trainer.evaluate())
        trainer.save_state()
        trainer.create_model_card()
        written[name] = {p.name: p.read_text() for p in (tmp_path / name).iterdir() if p.is_file()}
    expected = {"all_results.json", "train_results.json", "eval_results.json", "trainer_state.json", "README.md"}
    assert expected <= set(written["hf"]) and expected <= set(written["wb"])
    for file in ("all_results.json", "train_results.json", "eval_results.json"):
        theirs, ours = json.loads(written["hf"][file]), json.loads(written["wb"][file])
        assert list(ours) == list(theirs), file  # the same keys, sorted the same way
        assert untimed([ours]) == close([theirs]), file
    state = {f: json.loads(written[f]["trainer_state.json"]) for f in ("hf", "wb")}
    assert list(state["wb"]) == list(state["hf"])
    assert untimed(state["wb"]["log_history"]) == close(state["hf"]["log_history"])
    # The card: the same sections, hyperparameters and results table, and the same tag.
    cards = {f: written[f]["README.md"] for f in ("hf", "wb")}
    for heading in ("## Training procedure", "### Training hyperparameters", "### Training results",
                    "### Framework versions"):
        assert heading in cards["hf"] and heading in cards["wb"], heading
    for f in ("hf", "wb"):
        assert "generated_from_trainer" in cards[f] and f"# {f}\n" in cards[f]

    def section(card: str, heading: str) -> list[str]:
        body = card.split(heading, 1)[1].split("\n#", 1)[0]
        return [line for line in body.splitlines() if line.startswith(("- ", "|"))]

    ours, theirs = (section(cards[f], "### Training hyperparameters") for f in ("wb", "hf"))
    # HF writes the optimizer's enum member (OptimizerNames.ADAMW_TORCH_FUSED), workbench its value.
    assert [line for line in ours if "optimizer:" not in line] == [line for line in theirs if "optimizer:" not in line]
    [optimizer] = [line for line in ours if "optimizer:" in line]
    assert optimizer.startswith("- optimizer: Use adamw_torch_fused with betas=(0.9,0.999)")
    assert section(cards["wb"], "### Training results") == section(cards["hf"], "### Training results")
    assert any(line.startswith("- Transformers ") for line in section(cards["wb"], "### Framework versions"))


@needs_hf
def test_log_metrics_prints_and_metrics_format_formats_as_hf(capsys):
    metrics = {"train_runtime": 3725.127, "train_samples_per_second": 12.345678, "total_flos": 3 * 2**30 + 5,
               "train_loss": 0.123456789, "epoch": 2.0, "init_mem_cpu_alloc_delta": 5 * 2**20, "step_count": 7}
    hf_format = transformers.trainer_pt_utils.metrics_format
    assert Trainer.metrics_format(metrics) == hf_format(metrics)
    trainer = Trainer(model=MLPClassifier(4, 2), args=TrainingArguments("unused", report_to="none"))
    assert trainer.metrics_format(metrics) == hf_format(metrics)  # on an instance too (HF's fails there)
    trainer.log_metrics("train", metrics)
    ours = capsys.readouterr().out
    transformers.trainer_pt_utils.log_metrics(trainer, "train", metrics)
    assert ours == capsys.readouterr().out
    assert ours.splitlines()[0] == "***** train metrics *****" and "  train_runtime            = 1:02:05.12" in ours


def test_save_metrics_merges_all_results_and_push_to_hub_is_one_line(tmp_path):
    trainer = Trainer(model=MLPClassifier(4, 2), args=TrainingArguments(str(tmp_path), report_to="none"))
    trainer.save_metrics("train", {"train_loss": 1.0, "epoch": 1.0})
    trainer.save_metrics("eval", {"eval_loss": 2.0, "epoch": 1.0})
    trainer.save_metrics("test", {"test_loss": 3.0}, combined=False)
    assert json.loads((tmp_path / "all_results.json").read_text()) == {"epoch": 1.0, "eval_loss": 2.0,
                                                                      "train_loss": 1.0}
    assert json.loads((tmp_path / "test_results.json").read_text()) == {"test_loss": 3.0}
    with pytest.raises(RuntimeError) as raised:
        trainer.push_to_hub("End of training")
    assert "\n" not in str(raised.value) and "does not upload" in str(raised.value)


# -- item 9: transformers' callbacks --------------------------------------------------------------------

SCORES = {1: 0.5, 2: 0.6, 3: 0.55, 4: 0.58, 5: 0.59, 6: 0.7, 7: 0.1, 8: 0.1, 9: 0.1, 10: 0.1}
STOPPING = dict(max_steps=10, eval_steps=1, save_steps=3, metric_for_best_model="score", greater_is_better=True)


def scripted(trainer) -> None:
    """A score per evaluation step: it improves at steps 1 and 2, then not (patience 2 ends at 4)."""
    trainer.compute_metrics = lambda prediction: {"score": SCORES[trainer.state.global_step]}


@needs_hf
def test_transformers_early_stopping_stops_and_resumes_its_counter_as_in_hf(tmp_path):
    hf, wb = pair(tmp_path, callbacks=[lambda: transformers.EarlyStoppingCallback(2)], **STOPPING)
    for trainer in (hf, wb):
        scripted(trainer)
        trainer.train()
    assert hf.state.global_step == wb.state.global_step == 4
    saved = {f: json.loads((tmp_path / f / "checkpoint-3" / "trainer_state.json").read_text())["stateful_callbacks"]
             for f in ("hf", "wb")}
    assert saved["wb"] == saved["hf"]
    assert saved["wb"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] == 1

    def resumed(family: str, restore: bool) -> int:
        trainer_cls, args_cls = (transformers.Trainer, transformers.TrainingArguments) if family == "hf" \
            else (Trainer, TrainingArguments)
        args = args_cls(str(tmp_path / f"{family}-again"), **{**OPTIONS, **STOPPING},
                        restore_callback_states_from_checkpoint=restore)
        trainer = trainer_cls(model=bert(), args=args, train_dataset=rows(), eval_dataset=rows(16, seed=2),
                              callbacks=[transformers.EarlyStoppingCallback(2)])
        scripted(trainer)
        trainer.train(resume_from_checkpoint=str(tmp_path / family / "checkpoint-3"))
        return trainer.state.global_step

    # Restored, the counter goes on from 1 and the run stops where the uninterrupted one did;
    # not restored, it starts at 0 and the run goes one evaluation further: as in HF.
    assert resumed("wb", True) == resumed("hf", True) == 4
    assert resumed("wb", False) == resumed("hf", False) == 5


@needs_hf
def test_either_family_s_classes_remove_pop_and_add_callbacks(tmp_path, caplog):
    wb = Trainer(model=bert(), args=TrainingArguments(str(tmp_path / "a"), **OPTIONS), train_dataset=rows(),
                 eval_dataset=rows(16, seed=2))
    flow = next(cb for cb in wb.callback_handler.callbacks if isinstance(cb, DefaultFlowCallback))
    printer = wb.pop_callback(transformers.PrinterCallback)
    assert isinstance(printer, PrinterCallback)  # disable_tqdm: workbench's printer, found by HF's class
    with hf_logs(caplog, "transformers.trainer_callback"):
        wb.add_callback(transformers.DefaultFlowCallback)  # a second flow callback: HF's warning
    assert "You are adding a" in caplog.text and "but there is already one" in caplog.text
    wb.remove_callback(DefaultFlowCallback)  # workbench's class finds workbench's first
    assert flow not in wb.callback_handler.callbacks
    assert any(type(cb) is transformers.DefaultFlowCallback for cb in wb.callback_handler.callbacks)
    wb.train()  # transformers' flow callback decides when to log, evaluate and save
    plain = Trainer(model=bert(), args=TrainingArguments(str(tmp_path / "b"), **OPTIONS), train_dataset=rows(),
                    eval_dataset=rows(16, seed=2))
    plain.train()
    assert untimed(wb.state.log_history) == untimed(plain.state.log_history)
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    wb.remove_callback(transformers.DefaultFlowCallback)
    assert not any("DefaultFlowCallback" in type(cb).__name__ for cb in wb.callback_handler.callbacks)


@needs_hf
def test_isinstance_checks_across_the_families():
    theirs = transformers.EarlyStoppingCallback(3)
    assert isinstance(theirs, TrainerCallback) and isinstance(theirs, ExportableState)
    assert issubclass(transformers.TrainerCallback, TrainerCallback)
    # Only the base classes take transformers' in: workbench's own subclasses keep their meaning.
    assert not isinstance(theirs, EarlyStoppingCallback) and not isinstance(theirs, DefaultFlowCallback)
    assert not isinstance(transformers.PrinterCallback(), ExportableState)
    # workbench never imports transformers, so its callbacks are not transformers' (documented).
    assert not isinstance(EarlyStoppingCallback(), transformers.TrainerCallback)
    assert isinstance(EarlyStoppingCallback(), ExportableState) and not isinstance(object(), TrainerCallback)


# -- item 10: HF's loggers ---------------------------------------------------------------------------------


def hf_message(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == logging.WARNING]


@needs_hf
def test_warnings_come_out_on_hf_s_logger_names_with_hf_s_wording(tmp_path, caplog):
    texts = {}
    for family in ("hf", "wb"):
        caplog.clear()
        trainer_cls, args_cls, stopping = (
            (transformers.Trainer, transformers.TrainingArguments, transformers.EarlyStoppingCallback)
            if family == "hf" else (Trainer, TrainingArguments, EarlyStoppingCallback))
        args = args_cls(str(tmp_path / family), **{**OPTIONS, **STOPPING})
        with hf_logs(caplog, "transformers.trainer_callback"):
            trainer = trainer_cls(model=bert(), args=args, train_dataset=rows(), eval_dataset=rows(16, seed=2),
                                  callbacks=[stopping(2), stopping(2)])
            scripted(trainer)
            trainer.train()
        texts[family] = hf_message(caplog, "transformers.trainer_callback")
        caplog.clear()
        again = trainer_cls(model=bert(), args=args_cls(str(tmp_path / f"{family}-plain"), **{**OPTIONS, **STOPPING},
                                                        restore_callback_states_from_checkpoint=True),
                            train_dataset=rows(), eval_dataset=rows(16, seed=2))
        scripted(again)
        with hf_logs(caplog, "transformers.trainer"):
            again.train(resume_from_checkpoint=str(tmp_path / family / "checkpoint-3"))
        texts[family + "-resume"] = hf_message(caplog, "transformers.trainer")
    no_best = "Using EarlyStoppingCallback without load_best_model_at_end=True. Once training is finished, " \
              "the best model will not be loaded automatically."
    assert texts["hf"].count(no_best) == texts["wb"].count(no_best) == 2
    duplicate = [t for t in texts["wb"] if t.startswith("You are adding a")]
    assert len(duplicate) == 1 and len([t for t in texts["hf"] if t.startswith("You are adding a")]) == 1
    assert "to the callbacks of this Trainer, but there is already one." in duplicate[0]
    unknown = "Checkpoint included callbacks not included in current configuration. Ignoring. (EarlyStoppingCallback)"
    assert unknown in texts["hf-resume"] and unknown in texts["wb-resume"]


def test_hf_s_warnings_need_no_transformers_import_and_workbench_s_own_stay_apart(tmp_path):
    script = f"""
import logging, sys
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append((record.name, record.getMessage().split(" ")[0]))
logging.getLogger().addHandler(Keep())
from workbench.checkpoint.store import CheckpointStore
from workbench.core.callbacks import CallbackHandler
from workbench.train.callbacks import EarlyStoppingCallback
CallbackHandler([EarlyStoppingCallback(), EarlyStoppingCallback()], None, None, None, None)
(__import__("pathlib").Path({str(tmp_path)!r}) / ".tmp-checkpoint-1").mkdir()
CheckpointStore({str(tmp_path)!r}).clean_temporaries()
assert "transformers" not in sys.modules, "workbench imported transformers"
print(seen)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert eval(result.stdout) == [("transformers.trainer_callback", "You"), ("workbench", "removed")]


def test_resume_argument_and_dropped_column_warnings_use_hf_s_loggers(tmp_path, caplog):
    data = [{"x": torch.randn(8), "labels": torch.tensor(i % 3), "note": i} for i in range(16)]

    def trainer(**overrides):
        options = {"max_steps": 4, "save_steps": 2, "report_to": "none", "disable_tqdm": True, **overrides}
        args = TrainingArguments(str(tmp_path), **options)
        return Trainer(model=MLPClassifier(8, 3), args=args, train_dataset=data)

    with hf_logs(caplog, "transformers.trainer"):
        trainer(save_strategy="steps").train()
    assert [r.name for r in caplog.records if "dropping columns" in r.getMessage()] == ["transformers.trainer"]
    caplog.clear()
    with hf_logs(caplog, "transformers.trainer_utils"):
        trainer(save_strategy="steps", logging_steps=3, max_steps=6).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    names = [r.name for r in caplog.records if "in this launch but" in r.getMessage()]
    assert names == ["transformers.trainer_utils"] * 2  # logging_steps and max_steps differ


# -- item 11: TrainerState holds HF's fields only ---------------------------------------------------------


@needs_hf
def test_trainer_state_has_exactly_transformers_fields():
    ours = [f.name for f in dataclasses.fields(TrainerState)]
    assert ours == [f.name for f in dataclasses.fields(transformers.TrainerState)]
    assert dataclasses.asdict(TrainerState()) == dataclasses.asdict(transformers.TrainerState())  # defaults too
    # Given callbacks, both store their states by class name (a list for several of one class).
    ours = TrainerState(stateful_callbacks=[EarlyStoppingCallback(2), EarlyStoppingCallback(3)])
    theirs = transformers.TrainerState(stateful_callbacks=[transformers.EarlyStoppingCallback(2),
                                                           transformers.EarlyStoppingCallback(3)])
    assert ours.stateful_callbacks == theirs.stateful_callbacks


def mlp_trainer(out: Path, callbacks=(), **overrides: Any) -> Trainer:
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 3)} for i in range(40)]
    options = dict(max_steps=9, per_device_train_batch_size=4, logging_steps=4, save_strategy="steps", save_steps=3,
                   eval_strategy="steps", eval_steps=3, report_to="none", disable_tqdm=True, seed=0,
                   train_sampling_strategy="sequential")
    torch.manual_seed(0)
    return Trainer(model=MLPClassifier(8, 3), args=TrainingArguments(str(out), **{**options, **overrides}),
                   train_dataset=data, eval_dataset=data[:8], callbacks=list(callbacks))


def comparable(state: TrainerState, out: Path) -> dict[str, Any]:
    """The state as asdict gives it, with timings, and the end-of-run entry whose train_loss
    covers only that call's steps (HF's rule), left out; paths relative to the run."""
    data = dataclasses.asdict(state)
    data["log_history"] = untimed([e for e in data["log_history"] if "train_loss" not in e])
    data["best_model_checkpoint"] = os.path.relpath(data["best_model_checkpoint"], out)
    return data


def test_asdict_of_a_resumed_state_equals_an_uninterrupted_run_s(tmp_path):
    whole = mlp_trainer(tmp_path / "whole", metric_for_best_model="loss")
    whole.train()
    cut = mlp_trainer(tmp_path / "cut", [StopAt(3)], metric_for_best_model="loss")
    cut.train()
    saved = WorkbenchState.load(tmp_path / "cut" / "checkpoint-3")
    assert saved.loss_window["since_step"] == 0 and len(saved.loss_window["losses"]) == 3  # unlogged: in here
    assert set(json.loads((tmp_path / "cut" / "checkpoint-3" / "trainer_state.json").read_text())) == \
           {f.name for f in dataclasses.fields(TrainerState)}
    resumed = mlp_trainer(tmp_path / "cut", metric_for_best_model="loss")
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert comparable(resumed.state, tmp_path / "cut") == comparable(whole.state, tmp_path / "whole")
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e] == \
           [e["loss"] for e in whole.state.log_history if "loss" in e]


def test_a_checkpoint_with_workbench_fields_in_trainer_state_json_still_resumes(tmp_path):
    """Checkpoints written before workbench_state.json existed kept the loss window and the
    live edits in trainer_state.json: they resume with both."""
    whole = mlp_trainer(tmp_path / "whole")
    whole.train()
    mlp_trainer(tmp_path / "old", [StopAt(3)]).train()
    checkpoint = tmp_path / "old" / "checkpoint-3"
    extras = json.loads((checkpoint / "workbench_state.json").read_text())
    extras["live_edits"] = [{"step": 3, "time": 0.0, "note": "from an old checkpoint"}]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state.update({k: extras[k] for k in ("live_edits", "loss_window", "guard")})
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    (checkpoint / "workbench_state.json").unlink()
    CheckpointStore(tmp_path / "old").reseal(checkpoint)  # as it was sealed then: without the file
    resumed = mlp_trainer(tmp_path / "old")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e] == \
           [e["loss"] for e in whole.state.log_history if "loss" in e]  # the carried loss window was read
    assert resumed.workbench_state.live_edits == extras["live_edits"]
    assert "live_edits" not in json.loads((tmp_path / "old" / "checkpoint-6" / "trainer_state.json").read_text())


@needs_hf
def test_label_smoother_is_hf_s(tmp_path):
    plain = Trainer(model=bert(), args=TrainingArguments(str(tmp_path), report_to="none"))
    assert plain.label_smoother is None
    smoothed = Trainer(model=bert(), args=TrainingArguments(str(tmp_path), report_to="none",
                                                            label_smoothing_factor=0.1))
    theirs = transformers.trainer_pt_utils.LabelSmoother(epsilon=0.1)
    assert smoothed.label_smoother.epsilon == 0.1 and smoothed.label_smoother.ignore_index == theirs.ignore_index
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, :2] = -100
    for kwargs in ({}, {"shift_labels": True}, {"num_items_in_batch": torch.tensor(13)}):
        assert torch.allclose(smoothed.label_smoother({"logits": logits}, labels, **kwargs),
                              theirs({"logits": logits}, labels, **kwargs)), kwargs
    config = bert().config
    config.problem_type = "multi_label_classification"
    with pytest.warns(UserWarning, match="Label smoothing is not compatible"):
        multi = Trainer(model=transformers.BertForSequenceClassification(config),
                        args=TrainingArguments(str(tmp_path), report_to="none", label_smoothing_factor=0.1))
    assert multi.label_smoother is None


# -- item 12: resume by a checkpoint's name -----------------------------------------------------------------


def test_train_resumes_from_a_bare_checkpoint_name_of_the_output_dir(tmp_path, monkeypatch):
    out = tmp_path / "run"
    mlp_trainer(out, [StopAt(3)]).train()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no ./checkpoint-3 here: the name is the output_dir's
    resumed = mlp_trainer(out)
    resumed.train(resume_from_checkpoint="checkpoint-3")
    assert resumed.state.global_step == 9 and resumed.state.log_history[0]["step"] >= 3
    with pytest.raises(ValueError) as raised:
        mlp_trainer(out).train(resume_from_checkpoint="checkpoint-99")
    message = str(raised.value)
    assert "\n" not in message and "checkpoint-99" in message
    assert "checkpoint-3, checkpoint-6, checkpoint-9" in message  # the complete ones, to pick from


@needs_hf
def test_transformers_takes_a_bare_name_as_a_path_only(tmp_path, monkeypatch):
    """What HF does with the same name (README: workbench differs only when no such path exists)."""
    hf, _ = pair(tmp_path, max_steps=3)
    hf.train()
    monkeypatch.chdir(tmp_path)
    again = transformers.Trainer(model=bert(), args=transformers.TrainingArguments(str(tmp_path / "hf"), **OPTIONS),
                                 train_dataset=rows(), eval_dataset=rows(16, seed=2))
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at checkpoint-3"):
        again.train(resume_from_checkpoint="checkpoint-3")
