"""Control overhead: a run with a client process polling at 10 Hz over the control socket vs
the same run with no client; and command-to-event latency between client processes.

Overhead: both rows are Sessions (the control endpoint is served in both: what is measured
is the cost of a client using it). The client is a process of its own
(benchmarks/_control_client.py ``poll``) calling what the attached dashboard calls on each
refresh: ``snapshot()`` (series included), ``stop_reason`` and ``events_since()``. It is
started and imported before the run starts, so only its polling is timed. The run's series
are prefilled to their bound (2,000 points each, a long run's state) and the run logs every
``--logging-steps`` steps, so the series change while the client polls. Two figures per
row: steps/s, and the run process's CPU time per step (training thread plus the control
server's threads), the steadier one on a shared machine. Rows alternate within one
invocation; medians with [min, max].

Latency: one client process sends ``set(lr_scale=1.0)`` and ``pause()``; another, subscribed
to the event stream, stamps each ``edited`` / ``paused`` event on arrival (both stamp with
CLOCK_MONOTONIC, one clock for the machine). Reported: median, p95 and max milliseconds,
and how many steps ran between the command reaching the run and its event (at most 1: it
took effect at the next step boundary).

Results (2026-12-01, a 2-core CPU VM shared with three other agents' builds and tests: load
average 4-6, a step's CPU time ~3.5x the README's unloaded figure, wall-clock rates swinging
3x between runs, so CPU per step is the figure to read). Small MLP, batch 32, 2000 steps x
5-9 alternating, logging_steps 10, series full; median [range] of the ratio to no client:

  before (each poll deep-copied and encoded the whole series, ~38 ms of the run's CPU):
      CPU per step 2.62x [2592-3362 vs 6375-8756 µs], steps/s 0.32x
  after (series_since: the curves once, then deltas; fields converted once per snapshot):
      CPU per step 1.02x and 1.04x in two invocations (ranges overlap: 2908-3603 vs
      3140-3611 µs; 2928-3339 vs 2925-3469 µs), steps/s 0.87x and 1.04x (noise)
  so the 10 Hz client's cost fell from ~160% to within this machine's noise of 1-4%; the 1%
  target is not demonstrated here (the server's work per poll is ~0.3 ms of CPU loaded).
  latency, another client process (30 samples): set -> edited median 13 ms, p95 36 ms;
      pause -> paused median 7.8 ms, p95 15 ms; every command took effect at the next step.
Usage:
python benchmarks/control_overhead.py [--steps N] [--repeats R] [--logging-steps L] [--samples S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from _timing import Stopwatch, print_table, round_robin

from workbench import Session, Trainer, TrainingArguments
from workbench.data.builtin import load_builtin_data
from workbench.core.callbacks import TrainerCallback
from workbench.train.callbacks import PrinterCallback
from workbench.models import MLPClassifier

CLIENT = str(Path(__file__).with_name("_control_client.py"))


def make_session(steps: int, batch: int, train, out: str, logging_steps: int, prefill: int = 0) -> Session:
    """A Session on a small MLP; ``prefill`` synthetic log points first fill its series."""
    torch.manual_seed(0)
    model = MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
                             lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=logging_steps,
                             save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.remove_callback(PrinterCallback)  # the logs are not printed (both rows alike)
    session = Session(trainer)
    for i in range(prefill):  # benchmark-only: a long run's series, without running it
        session._series.add_log(i - prefill, {"loss": 1.0 / (i + 1), "learning_rate": 1e-3, "grad_norm": 0.5})
    return session


def client(mode: str, out: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CLIENT, mode, out, *extra], stdout=subprocess.PIPE, text=True)


class _Clock(TrainerCallback):
    """Times the training loop alone (first step to the end), not the run's set-up."""

    def __init__(self) -> None:
        self.watch, self.started = Stopwatch(), False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.started:
            self.started = True
            self.watch.begin()

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.end()


def timed_run(session: Session, steps: int) -> tuple[float, float]:
    """(steps/s, CPU µs per step of this process) of one run's loop."""
    clock = _Clock()
    session.trainer.add_callback(clock)
    session.start().wait()
    return steps / clock.watch.loop, clock.watch.loop_cpu / steps * 1e6


def no_client(steps: int, batch: int, train, out: str, logging_steps: int, polls: list) -> tuple[float, float]:
    return timed_run(make_session(steps, batch, train, tempfile.mkdtemp(dir=out), logging_steps, 4000), steps)


def polling_client(steps: int, batch: int, train, out: str, logging_steps: int, polls: list) -> tuple[float, float]:
    run_dir = tempfile.mkdtemp(dir=out)
    session = make_session(steps, batch, train, run_dir, logging_steps, 4000)
    poller = client("poll", run_dir, "--hz", "10")
    assert json.loads(poller.stdout.readline()) == {"ready": True}
    result = timed_run(session, steps)
    report = json.loads(poller.stdout.readline())
    poller.wait()
    if not report["polls"]:
        raise RuntimeError("the client never polled")
    polls.append(report["polls"])
    return result


def latency(train, out: str, batch: int, samples: int) -> dict[str, list[tuple[float, int]]]:
    """Per command kind: (ms from sending to the event's arrival at the other client, steps between)."""
    session = make_session(10**8, batch, train, out, logging_steps=50, prefill=4000)
    arrived: dict[str, list[int]] = {"edited": [], "paused": []}  # the run's step when each command came in
    for kind, name in (("edited", "set"), ("paused", "pause")):
        setattr(session, name, _noting(getattr(session, name), session, arrived[kind]))
    session.start()
    watcher = client("watch", out)
    try:
        assert json.loads(watcher.stdout.readline()) == {"ready": True}
        while session.trainer.state.global_step < 20:  # past the first steps' one-time costs
            time.sleep(0.05)
        actor = client("act", out, "--samples", str(samples))
        sent = json.loads(actor.stdout.readline())["sent"]
        actor.wait()
    finally:
        session.stop(save=False)
        session.wait()
        session.close()  # a start()ed Session serves its ended run until closed; the watcher waits for that
    seen = [json.loads(line) for line in watcher.stdout]
    watcher.wait()
    found: dict[str, list[tuple[float, int]]] = {"edited": [], "paused": []}
    for kind, rows in found.items():
        arrivals = [e for e in seen if e["kind"] == kind]
        for command, event, step in zip((s for s in sent if s["kind"] == kind), arrivals, arrived[kind], strict=True):
            rows.append(((event["t"] - command["t"]) * 1e3, event["step"] - step))
    return found


def _noting(method, session: Session, steps: list[int]):
    """``method``, noting the run's step each time the control server calls it."""
    def noted(*args, **kwargs):
        steps.append(session.trainer.state.global_step)
        return method(*args, **kwargs)
    return noted


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--skip-overhead", action="store_true")
    ns = parser.parse_args()
    torch.set_num_threads(1)  # overhead-bound on purpose: the model is tiny
    train, _ = load_builtin_data("random-classification", n_train=8192)
    polls: list[int] = []
    runners = {"Session, no client": no_client, "Session + client process, 10 Hz": polling_client}
    with tempfile.TemporaryDirectory() as tmp:
        if not ns.skip_overhead:
            no_client(200, ns.batch, train, tmp, ns.logging_steps, polls)  # warm-up (imports, allocator)
            results = round_robin({name: partial(run, ns.steps, ns.batch, train, tmp, ns.logging_steps, polls)
                                   for name, run in runners.items()}, ns.repeats)
            rates = {name: [r[0] for r in rows] for name, rows in results.items()}
            cpu = {name: spread([r[1] for r in rows]) for name, rows in results.items()}
            base = statistics.median(r[1] for r in results["Session, no client"])
            ratio = {name: f"{statistics.median(r[1] for r in rows) / base:.3f}" for name, rows in results.items()}
            print_table(f"small MLP, batch {ns.batch}, {ns.steps} steps x {ns.repeats} repeats, logging_steps "
                        f"{ns.logging_steps}, series full, alternating (median steps/s)", rates,
                        baseline="Session, no client", extra={"CPU µs/step [range]": cpu, "CPU ratio": ratio})
            print(f"client polls per run: {spread([float(p) for p in polls])}")
        for kind, rows in latency(train, str(Path(tmp) / "latency"), ns.batch, ns.samples).items():
            ms = sorted(r[0] for r in rows)
            steps = [r[1] for r in rows]
            print(f"{'set' if kind == 'edited' else 'pause'} -> {kind} at another client: median "
                  f"{statistics.median(ms):.1f} ms, p95 {ms[int(0.95 * (len(ms) - 1))]:.1f} ms, max {ms[-1]:.1f} ms; "
                  f"steps from the command's arrival to its event: median {statistics.median(steps):g}, max {max(steps)}")


if __name__ == "__main__":
    main()
