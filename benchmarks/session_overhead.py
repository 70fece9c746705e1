"""Session overhead: a Session with a front-end polling snapshot() at 10 Hz vs the bare Trainer.

Same model, data, optimizer, schedule, clipping and batch size as benchmarks/overhead.py
(a small MLP: overhead-bound on purpose, so any per-step cost of the Session shows). The
Session run is timed from start() to the end of wait(), with a consumer thread reading a
snapshot (status, step, throughput, the loss series, memory) ten times a second, as the
dashboard and the notebook panel do. The two runners alternate within one invocation (the
first of each pair alternates too) and the table reports medians, so machine noise hits
both rows alike. Usage: python benchmarks/session_overhead.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial

import torch
from _timing import print_table, round_robin, watch_session

from workbench import Session, Trainer, TrainingArguments
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier


def make_trainer(steps: int, batch: int, train, out: str) -> Trainer:
    torch.manual_seed(0)
    model = MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
                             lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=100,
                             save_strategy="no", report_to="none", disable_tqdm=True, optim="adamw_torch_fused")
    return Trainer(model=model, args=args, train_dataset=train)


def bare_trainer(steps: int, batch: int, train, out: str) -> float:
    trainer = make_trainer(steps, batch, train, out)
    start = time.perf_counter()
    trainer.train()
    return steps / (time.perf_counter() - start)


def session_with_poller(steps: int, batch: int, train, out: str) -> float:
    session = Session(make_trainer(steps, batch, train, out))
    start = time.perf_counter()
    status, polls = watch_session(session, every=0.1)
    elapsed = time.perf_counter() - start
    if status != "finished" or session.trainer.state.global_step != steps:
        raise RuntimeError(f"the session run ended {status} at step {session.trainer.state.global_step}")
    if not polls:
        raise RuntimeError("the consumer never polled")
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    ns = parser.parse_args()
    torch.set_num_threads(1)  # overhead-bound on purpose: the model is tiny
    train, _ = load_builtin_data("random-classification", n_train=8192)

    runners = {"bare Trainer": bare_trainer, "Session + 10 Hz poller": session_with_poller}
    with tempfile.TemporaryDirectory() as tmp:
        bare_trainer(200, ns.batch, train, tmp)  # warm-up (imports, allocator, kernels)
        results = round_robin({name: partial(run, ns.steps, ns.batch, train, tmp) for name, run in runners.items()},
                              ns.repeats)
    print_table(f"small MLP, batch {ns.batch}, {ns.steps} steps x {ns.repeats} repeats, alternating (median steps/s)",
                results, baseline="bare Trainer")


if __name__ == "__main__":
    main()
