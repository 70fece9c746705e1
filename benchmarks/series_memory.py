"""Memory per logged step: what a run's process keeps for 1,000,000 logged steps.

A real 1M-step run is too slow for this machine, so the steps are synthetic: each one is a
``Trainer.log(logs)`` call on a real Trainer wrapped in a real Session (the path every
logging step of a run takes: ``state.log_history`` gets the entry, then the Session's
``on_log`` adds the points to its SeriesStore, emits a ``logged`` event into its EventHub
and publishes a snapshot). Only the Session's callback is kept on that path (the printer
and the events.jsonl sink write out and keep nothing). At 10k, 100k and 1M steps it
reports the deep size of the series, the event history and ``state.log_history``, and
tracemalloc's count of everything else the process allocated since the start (traced
memory less log_history; ``--no-tracemalloc`` skips it, as it slows each log ~5x) and the
process's RSS: the series and events must stay flat. ``log_history`` grows by
one dict per log, as it does in transformers' Trainer (it is saved in trainer_state.json).

Results (2026-12-01, loaded 2-core VM; deep sizes; "traced" from a --steps 100000 run with
tracemalloc, the 1M row from a run without it):

  logged steps   series    event history  log_history  traced - log_history   RSS
        10,000   0.47 MiB  0.96 MiB        3.02 MiB    1.02 MiB               243 MiB
       100,000   0.36 MiB  0.96 MiB       30.14 MiB    1.35 MiB               276 MiB
     1,000,000   0.42 MiB  0.96 MiB      301.79 MiB    -                      588 MiB

The series (3 x ~1,500-2,000 points) and the event history (2,000 events) are flat.
``state.log_history`` is not: ~316 bytes per log, 302 MiB at 1M logs, and it is most of the
RSS growth (as in transformers, whose Trainer keeps the same list and saves it in
trainer_state.json). The rest grew 0.33 MiB over 90k logs (~4 bytes a log, not tracked
down). Usage: python benchmarks/series_memory.py [--steps N] [--no-tracemalloc]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import tracemalloc

import torch

from workbench import Session, Trainer, TrainingArguments
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier
from workbench.session.local import SessionObserver


def deep_size(root: object) -> int:
    """Bytes of ``root`` and everything it holds (containers, tuples, numbers, strings), once each."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, name) for name in obj.__slots__ if hasattr(obj, name))
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.append(vars(obj))
    return total


def rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--no-tracemalloc", action="store_true",
                        help="skip tracemalloc (it slows each log ~5x): deep sizes and RSS only")
    ns = parser.parse_args()
    train, _ = load_builtin_data("random-classification", n_train=64)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, max_steps=ns.steps, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True)
        trainer = Trainer(model=MLPClassifier(in_features=32, hidden=8, num_classes=4), args=args, train_dataset=train)
        session = Session(trainer, control=False)
        handler = trainer.callback_handler
        handler.callbacks = [cb for cb in handler.callbacks if isinstance(cb, SessionObserver)]
        state = trainer.state
        state.max_steps = ns.steps
        handler.on_train_begin(args, state, trainer.control)
        marks = sorted({m for m in (10_000, 100_000, 1_000_000, ns.steps) if m <= ns.steps})
        if not ns.no_tracemalloc:
            tracemalloc.start()
        began = time.perf_counter()
        print(f"{'logged steps':>12} {'series':>11} {'event history':>14} {'log_history':>12} "
              f"{'traced - log_history':>21} {'RSS':>10} {'µs/log':>7}")
        for step in range(1, ns.steps + 1):
            state.global_step = step
            state.epoch = step / 1000
            trainer.log({"loss": 1.0 / step, "grad_norm": 0.5 + (step % 7) / 10, "learning_rate": 1e-3 * (1 - step / ns.steps)})
            if step == marks[0]:
                marks.pop(0)
                history = deep_size(state.log_history)
                traced = tracemalloc.get_traced_memory()[0] - history if tracemalloc.is_tracing() else None
                print(f"{step:>12,} {mib(deep_size(session._series._data)):>11} "
                      f"{mib(deep_size(session._events._history)):>14} {mib(history):>12} "
                      f"{mib(traced) if traced is not None else '-':>21} {mib(rss()):>10} "
                      f"{(time.perf_counter() - began) / step * 1e6:>7.0f}", flush=True)
                if not marks:
                    break
        tracemalloc.stop()
        points = {k: len(v) for k, v in session.snapshot().series.items()}
        print(f"series points kept: {points}; log_history entries: {len(state.log_history):,} "
              f"(~{deep_size(state.log_history) / len(state.log_history):.0f} bytes each)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
