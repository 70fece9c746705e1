"""The autopilot's cost per step: a Session with an Autopilot following it vs the same Session alone.

The autopilot is a client (workbench/autopilot/): it reads ``events_since`` and the snapshot
from a thread of its own, as the dashboard does, and sends a change only when a policy asks.
Here it runs the plateau policy (halve the rate when eval_loss is flat for 3 evaluations, at
most 2 changes per 500 steps) and polls every 0.1 s (five times its default rate), on the
small MLP of benchmarks/session_overhead.py (overhead-bound on purpose: a per-step cost
shows), evaluating every 100 steps. The two runners alternate within one invocation (the
first of each pair alternates too) and the table reports medians, so machine noise hits both
rows alike. Usage: python benchmarks/autopilot.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial

import torch
from _timing import print_table, round_robin

from workbench import Session, Trainer, TrainingArguments
from workbench.autopilot import Autopilot, Limits, PlateauPolicy
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier

DECISIONS: list[int] = []  # the autopilot's decisions per run (shown under the table)


def make_session(steps: int, batch: int, data, out: str) -> Session:
    """The small MLP's run as a Session, evaluated every 100 steps."""
    train, evals = data
    torch.manual_seed(0)
    model = MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
                             lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=100, eval_strategy="steps",
                             eval_steps=100, save_strategy="no", report_to="none", disable_tqdm=True,
                             optim="adamw_torch_fused")
    return Session(Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals))


def timed(session: Session, steps: int) -> float:
    start = time.perf_counter()
    session.start()
    status = session.wait()
    elapsed = time.perf_counter() - start
    if status != "finished" or session.trainer.state.global_step != steps:
        raise RuntimeError(f"the run ended {status} at step {session.trainer.state.global_step}")
    return steps / elapsed


def session_alone(steps: int, batch: int, data, out: str) -> float:
    return timed(make_session(steps, batch, data, out), steps)


def session_with_autopilot(steps: int, batch: int, data, out: str) -> float:
    session = make_session(steps, batch, data, out)
    pilot = Autopilot(session, PlateauPolicy(patience=3), Limits({"lr_scale": (0.25, 1.0)}, max_changes=2,
                                                                 per_steps=500), interval=0.1).start()
    rate = timed(session, steps)
    pilot.stop()
    DECISIONS.append(len(pilot.decisions))
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    ns = parser.parse_args()
    torch.set_num_threads(1)  # overhead-bound on purpose: the model is tiny
    data = load_builtin_data("random-classification", n_train=8192, n_eval=256)

    runners = {"Session": session_alone, "Session + autopilot (10 Hz)": session_with_autopilot}
    with tempfile.TemporaryDirectory() as tmp:
        session_alone(200, ns.batch, data, tmp)  # warm-up (imports, allocator, kernels)
        results = round_robin({name: partial(run, ns.steps, ns.batch, data, tmp) for name, run in runners.items()},
                              ns.repeats)
    print_table(f"small MLP, batch {ns.batch}, {ns.steps} steps x {ns.repeats} repeats, eval every 100 steps, "
                "alternating (median steps/s)", results, baseline="Session")
    print(f"autopilot decisions per run: {DECISIONS}")


if __name__ == "__main__":
    main()
