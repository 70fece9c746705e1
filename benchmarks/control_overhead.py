"""Control overhead: a run with a remote client polling snapshot() at 10 Hz over the control
socket vs the same run with no client; and command-to-event latency.

Both rows are Sessions (the control endpoint is served in both: what is measured is the
cost of a client using it). The client runs in a thread of the same process, so its JSON
decoding competes for the GIL too: a client in another process (the real case) costs the
run less than this. Runners alternate within one invocation and the table reports medians.
Latency: the time from a ``set(lr_scale=1.0)`` / ``pause()`` sent by one client until the
matching event arrives on another client's subscribed stream.
Usage: python benchmarks/control_overhead.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch
from _timing import print_table, round_robin

from workbench import Session, Trainer, TrainingArguments
from workbench.control.client import attach
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier


def make_session(steps: int, batch: int, train, out: str) -> Session:
    torch.manual_seed(0)
    model = MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
                             lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=500,
                             save_strategy="no", report_to="none", disable_tqdm=True)
    return Session(Trainer(model=model, args=args, train_dataset=train))


def no_client(steps: int, batch: int, train, out: str) -> float:
    session = make_session(steps, batch, train, out)
    start = time.perf_counter()
    session.start().wait()
    return steps / (time.perf_counter() - start)


def polling_client(steps: int, batch: int, train, out: str) -> float:
    session = make_session(steps, batch, train, out)
    start = time.perf_counter()
    session.start()
    polls = [0]

    def poll() -> None:
        remote = attach(out)
        while session.status not in ("finished", "stopped", "failed"):
            remote.snapshot()  # the full snapshot, series included, as the dashboard reads it
            polls[0] += 1
            time.sleep(0.1)
        remote.close()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    session.wait()
    elapsed = time.perf_counter() - start
    thread.join()
    if not polls[0]:
        raise RuntimeError("the client never polled")
    return steps / elapsed


def latency(train, out: str, samples: int = 20) -> dict[str, float]:
    """Median and max milliseconds from a command to its event on another client's stream."""
    session = make_session(10**7, 32, train, out).start()
    actor, watcher = attach(out), attach(out)
    stream = watcher.events(cursor=watcher.events_since(0)[1])
    found: dict[str, list[float]] = {"set -> edited": [], "pause -> paused": []}
    try:
        for _ in range(samples):
            t0 = time.perf_counter()
            actor.set(lr_scale=1.0)
            next(e for e in stream if e.kind == "edited")
            found["set -> edited"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            actor.pause()
            next(e for e in stream if e.kind == "paused")
            found["pause -> paused"].append((time.perf_counter() - t0) * 1e3)
            actor.resume()
            next(e for e in stream if e.kind == "resumed")
    finally:
        session.stop(save=False)
        session.wait()
    return {f"{k} median": statistics.median(v) for k, v in found.items()} | {
        f"{k} max": max(v) for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    ns = parser.parse_args()
    torch.set_num_threads(1)  # overhead-bound on purpose: the model is tiny
    train, _ = load_builtin_data("random-classification", n_train=8192)
    runners = {"Session, no client": no_client, "Session + remote client, snapshot at 10 Hz": polling_client}
    with tempfile.TemporaryDirectory() as tmp:
        no_client(200, ns.batch, train, tmp)  # warm-up (imports, allocator, kernels)
        results = round_robin({name: partial(run, ns.steps, ns.batch, train, tmp) for name, run in runners.items()},
                              ns.repeats)
        print_table(f"small MLP, batch {ns.batch}, {ns.steps} steps x {ns.repeats} repeats, alternating "
                    "(median steps/s)", results, baseline="Session, no client")
        for name, ms in latency(train, str(Path(tmp) / "latency")).items():
            print(f"{name}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
