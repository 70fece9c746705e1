"""Throughput and MFU (train/throughput.py) on real CPU runs: tokens/s counts the non-padding
tokens the data path marks (its collator's ``attention_mask``), FLOP/s is the model's own count
or 6 x non-embedding parameters x input tokens, MFU is FLOP/s over a ``[health] peak_tflops``
override and absent on the CPU without one, the peak table is looked up by the device's name
and the run's precision, evaluation and paused time stay out of a window's seconds, and the
live tokens/s of a snapshot counts what the logs count (session/progress.py).

A window's rates share one denominator (its training seconds), so their ratios are exact
figures of the batches trained: tokens/s over samples/s is the window's tokens a sample."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from workbench import Trainer, TrainerCallback
from workbench.core.event_file import read_events
from workbench.core.run import Gate
from workbench.data.collators import DataCollatorWithPadding
from workbench.distributed.health import Health
from workbench.session.progress import progress
from workbench.train.throughput import PEAK_TFLOPS, Throughput, device_peak_tflops

from support.runs import make_args
from support.waiting import wait_until

VOCAB, LONGEST, PROMPT = 32, 12, 2
PAD = SimpleNamespace(pad_token_id=0, padding_side="right")  # all the data path's padding needs of a tokenizer


class Rows(Dataset):
    """Token rows of 3 to LONGEST tokens (padded per batch by the collator), labels -100 on
    each row's first PROMPT tokens: a prompt the loss leaves out, input the model still reads."""

    def __init__(self, n: int = 32) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, LONGEST + 1, (n,), generator=gen).tolist()
        self.rows = [torch.randint(1, VOCAB, (k,), generator=gen).tolist() for k in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = self.rows[i]
        return {"input_ids": ids, "labels": [-100] * PROMPT + ids[PROMPT:]}


class Lm(nn.Module):
    """A tiny language model with no FLOP count of its own and no parameter count."""

    main_input_name = "input_ids"

    def __init__(self, eval_sleep: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.eval_sleep = eval_sleep

    def forward(self, input_ids, attention_mask=None, labels=None):
        if not self.training and self.eval_sleep:
            time.sleep(self.eval_sleep)  # a slow evaluation: not training time
        logits = self.head(self.embed(input_ids))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


class Counted(Lm):
    """Counts its parameters as transformers models do: FLOP by the 6 x parameters x tokens rule."""

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for name, p in self.named_parameters()
                   if not (exclude_embeddings and name.startswith("embed.")))


class OwnCount(Lm):
    """Has its own ``floating_point_ops`` (as transformers 4.x models did): a million a row."""

    def floating_point_ops(self, inputs) -> int:
        return 1_000_000 * inputs["input_ids"].shape[0]


class Batches(TrainerCallback):
    """The batch of each step (one micro-batch a step), by step."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.by_step: dict[int, dict] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.by_step[state.global_step] = self.trainer.last_inputs


class Hold(Gate):
    """Holds the loop before step ``at + 1`` for ``seconds``, as a pause does (the ledger books
    it as paused: the loop enters that phase before the steering gates)."""

    def __init__(self, at: int, seconds: float) -> None:
        self.at, self.seconds = at, seconds

    def step_start(self, run) -> None:
        if run.state.global_step == self.at:
            time.sleep(self.seconds)


def _trainer(out, model: Lm, *, steps: int = 6, health: Health | None = None, **extra) -> tuple[Trainer, Batches]:
    batches = Batches()
    args = make_args(out, max_steps=steps, per_device_train_batch_size=4, learning_rate=0.01, seed=0, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), eval_dataset=Rows(4),
                      data_collator=DataCollatorWithPadding(PAD), callbacks=[batches], health=health)
    batches.trainer = trainer
    return trainer, batches


def _logs(out) -> list[dict]:
    """The loss logs of events.jsonl, each with the rates of its window."""
    return [e for e in read_events(out) if e["event"] == "log" and "loss" in e]


def test_tokens_are_the_non_padding_tokens_the_data_path_marks(tmp_path):
    trainer, batches = _trainer(tmp_path, Lm(), include_num_input_tokens_seen="non_padding")
    trainer.train()
    logs = _logs(tmp_path)
    assert [e["step"] for e in logs] == [1, 2, 3, 4, 5, 6]
    padded = 0
    for e in logs:
        mask = batches.by_step[e["step"]]["attention_mask"]
        rows = mask.shape[0]
        per_sample = e["train_tokens_per_second"] / e["train_samples_per_second"]
        assert per_sample == pytest.approx(mask.sum().item() / rows, rel=1e-3)
        padded += mask.sum().item() < mask.numel()
        # Prompt tokens (labels -100) are input the model reads: counted; only padding is not.
        targets = (batches.by_step[e["step"]]["labels"] != -100).sum().item()
        assert mask.sum().item() == targets + PROMPT * rows
    assert padded, "no batch was padded: the data does not test the rule"
    # The loop's own count of the run (HF's num_input_tokens_seen) is the same rule.
    assert trainer.state.num_input_tokens_seen == sum(b["attention_mask"].sum().item() for b in batches.by_step.values())


def test_a_checkpoint_between_two_logs_holds_every_steps_tokens(tmp_path):
    """Tokens are summed at logs (no per-step sync), yet a checkpoint of step 3 with logs every
    5 steps holds steps 1-3's tokens, as HF's (which counts each step) does."""
    import json

    trainer, batches = _trainer(tmp_path, Lm(), include_num_input_tokens_seen="non_padding", logging_steps=5,
                                save_strategy="steps", save_steps=3)
    trainer.train()
    saved = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert saved["num_input_tokens_seen"] == sum(batches.by_step[s]["attention_mask"].sum().item() for s in (1, 2, 3))
    assert trainer.state.num_input_tokens_seen == sum(b["attention_mask"].sum().item() for b in batches.by_step.values())


def test_flops_are_the_models_own_count_else_six_x_parameters_x_tokens(tmp_path):
    own, _ = _trainer(tmp_path / "own", OwnCount(), steps=3)
    own.train()
    for e in _logs(tmp_path / "own"):
        assert e["train_flops_per_second"] / e["train_samples_per_second"] == pytest.approx(1e6, rel=1e-3)

    model = Counted()
    parameters = model.num_parameters(exclude_embeddings=True)
    assert parameters == 8 * VOCAB + VOCAB  # the head; the embedding is left out
    rule, batches = _trainer(tmp_path / "rule", model, steps=3)
    rule.train()
    for e in _logs(tmp_path / "rule"):
        ids = batches.by_step[e["step"]]["input_ids"]
        per_sample = 6 * parameters * ids.numel() / ids.shape[0]  # every input position, padding too: it is computed
        assert e["train_flops_per_second"] / e["train_samples_per_second"] == pytest.approx(per_sample, rel=1e-3)

    # Neither a count nor parameters counted: no FLOP figure and no MFU, even with a peak.
    neither, _ = _trainer(tmp_path / "neither", Lm(), steps=2, health=Health(peak_tflops=100.0))
    neither.train()
    assert all("train_flops_per_second" not in e and "mfu" not in e for e in _logs(tmp_path / "neither"))
    assert neither.throughput.latest and "mfu" not in neither.throughput.latest


def test_mfu_is_flops_per_second_over_the_peak_override_and_absent_on_the_cpu_without_one(tmp_path):
    peak = 1e-6  # TFLOP/s: a peak this low keeps the figure well above the 4 decimals it is rounded to
    with_peak, _ = _trainer(tmp_path / "peak", OwnCount(), steps=3, health=Health(peak_tflops=peak))
    with_peak.train()
    logs = _logs(tmp_path / "peak")
    assert logs and all(e["mfu"] == pytest.approx(e["train_flops_per_second"] / (peak * 1e12), rel=1e-6)
                        for e in logs)
    assert with_peak.throughput.latest["mfu"] == logs[-1]["mfu"]  # what the Session's health shows

    cpu, _ = _trainer(tmp_path / "cpu", OwnCount(), steps=3)
    cpu.train()
    logs = _logs(tmp_path / "cpu")
    assert logs and all(e["train_flops_per_second"] > 0 and "mfu" not in e for e in logs)
    assert device_peak_tflops(torch.device("cpu"), "bf16") is None
    assert device_peak_tflops(torch.device("cpu"), None, override=50.0) == 50.0


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),  # the longest matching entry wins over "H100"
    ("NVIDIA H100 PCIe", "no", 378.0),  # float32 runs on tf32
    ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),  # not "A10"
    ("NVIDIA A10G", None, 35.0),
    ("NVIDIA GH200 480GB", "bf16", 989.0),
    ("NVIDIA L40S", "bf16", 362.0),  # not "L4"
    ("Tesla T4", "fp16", 65.0),
    ("NVIDIA RTX A6000", "bf16", None),  # not in the table: no MFU rather than a guess
])
def test_the_peak_is_looked_up_by_device_name_and_precision(monkeypatch, name, precision, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda", 0), precision) == expected
    assert device_peak_tflops(torch.device("cuda", 0), precision, override=123.0) == 123.0
    assert all(set(entry) == {"bf16", "fp32"} for entry in PEAK_TFLOPS.values())


def test_evaluation_and_paused_time_are_left_out_of_the_rates(tmp_path):
    idle = 1.0  # seconds of evaluation, and of a pause, each far above two tiny steps' time
    trainer, batches = _trainer(tmp_path, Lm(eval_sleep=idle), steps=6, logging_steps=2, eval_strategy="steps",
                                eval_steps=2, per_device_eval_batch_size=4)
    trainer.gates.set("steering", Hold(at=4, seconds=idle))
    trainer.train()
    logs = _logs(tmp_path)
    assert [e["step"] for e in logs] == [2, 4, 6]
    summary = trainer.ledger.summary()
    assert summary["evaluation"] >= 3 * idle and summary["paused"] >= idle
    for before, e in zip(logs, logs[1:]):
        # The window of steps 3-4 holds step 2's evaluation; that of steps 5-6 step 4's and the pause.
        assert e["time"] - before["time"] >= idle
        samples = sum(batches.by_step[s]["input_ids"].shape[0] for s in (e["step"] - 1, e["step"]))
        seconds = samples / e["train_samples_per_second"]  # the window's training seconds
        assert seconds < idle / 2, f"step {e['step']}: {seconds:.3f} s counted for two tiny steps"


def test_the_live_tokens_per_second_counts_what_the_logs_count(tmp_path, sessions):
    from workbench import Session

    trainer, batches = _trainer(tmp_path, Lm(), steps=6)
    trainer.train()
    last = batches.by_step[6]["attention_mask"]
    assert trainer.throughput.tokens_per_sample == pytest.approx(last.sum().item() / last.shape[0])
    # A snapshot's figure: samples/s (every step of 4 rows, over 2 s) times the logs' tokens a sample.
    live = progress(trainer, time.perf_counter() - 2.0, 0)
    assert live["samples_per_second"] == pytest.approx(6 * 4 / 2.0, rel=1e-2)
    assert live["tokens_per_second"] == pytest.approx(live["samples_per_second"] * last.sum().item() / 4)
    assert live["tokens_per_second"] < live["samples_per_second"] * last.shape[1]  # not the padded length

    # Before the first log: a mask is on the device, read only at a logging point (no host sync
    # a step), so the figure is unknown; input ids alone are counted on the host, known at once.
    throughput = Throughput()
    throughput.start(torch.device("cpu"), None)
    first = DataCollatorWithPadding(PAD)([Rows()[i] for i in range(4)])
    throughput.add(first, 4, 0.0)
    assert throughput.tokens_per_sample is None
    assert progress(SimpleNamespace(state=trainer.state, args=trainer.args, accelerator=trainer.accelerator,
                                    throughput=throughput), time.perf_counter() - 2.0, 0)["tokens_per_second"] is None
    throughput.window()
    assert throughput.tokens_per_sample == first["attention_mask"].sum().item() / 4
    throughput.start(torch.device("cpu"), None)
    throughput.add({"input_ids": first["input_ids"]}, 4, 0.0)
    assert throughput.tokens_per_sample == first["input_ids"].shape[1]

    # And a Session's snapshot, paused after step 3, shows that step's window's figure.
    trainer, batches = _trainer(tmp_path / "live", Lm(), steps=6)
    session = Session(trainer)
    sessions.append(session)

    class PauseAfter3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                session.pause()

    trainer.add_callback(PauseAfter3())
    session.start()
    wait_until(lambda: session.status == "paused", "the pause")
    snap = session.snapshot()
    mask = batches.by_step[3]["attention_mask"]
    assert snap.tokens_per_second == pytest.approx(snap.samples_per_second * mask.sum().item() / mask.shape[0])
    session.resume()
    assert session.wait(60) == "finished"
