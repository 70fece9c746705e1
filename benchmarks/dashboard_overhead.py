"""Dashboard overhead: training steps/s with the terminal dashboard attached vs headless.

The same run (the tiny-gpt demo config, evaluation and saving off, a loss log every 5 steps
so the charts redraw as often as they ever do) is trained alternately without a front-end
and under the Textual dashboard (``App.run_test``: the full app, rendering every frame,
with a headless driver instead of a terminal). Both are timed from the start to the end of
the train loop (start-up is not counted): steps per wall second, and process CPU time per
step, which also counts the dashboard's own work and is less sensitive to other load on
the machine. The table reports medians over the repeats; the target is a ratio >= 0.97.

Usage: python benchmarks/dashboard_overhead.py [--steps N] [--repeats R] [--size 120x40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from workbench import Session, TrainerCallback
from workbench.door.values import ENDED

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt.toml"


class Clock(TrainerCallback):
    """Wall and process CPU time between the start and the end of the train loop."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.wall, self.cpu, self.step = time.perf_counter(), time.process_time(), state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        self.steps = state.global_step - self.step


def make_session(steps: int, out: str) -> tuple[Session, Clock]:
    overrides = {
        "training.output_dir": out,
        "training.max_steps": steps,
        "training.eval_strategy": "no",
        "training.eval_on_start": False,
        "training.save_strategy": "no",
        "training.logging_steps": 5,
        "training.report_to": "none",
        "training.disable_tqdm": True,
    }
    session = Session.from_config(CONFIG, overrides=overrides)
    clock = Clock()
    session.trainer.add_callback(clock)
    return session, clock


def headless(steps: int, out: str) -> Clock:
    """A Session that nobody watches."""
    session, clock = make_session(steps, out)
    session.start()
    session.wait()
    return clock


def with_dashboard(steps: int, out: str, size: tuple[int, int]) -> Clock:
    """The same Session while the dashboard polls, charts and logs it."""
    from workbench.widgets.tui import DashboardApp

    session, clock = make_session(steps, out)
    app = DashboardApp(session)

    async def run() -> None:
        async with app.run_test(size=size):
            # asyncio.sleep, not pilot.pause: the Pilot's own idle checks are test harness
            # work that a real terminal session does not have.
            start = time.thread_time()  # the app's loop runs in this (main) thread
            while session.status not in ENDED:
                await asyncio.sleep(0.2)
            clock.ui_cpu = time.thread_time() - start

    asyncio.run(run())
    session.wait()
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="120x40", help="terminal size of the dashboard, WxH")
    ns = parser.parse_args()
    size = tuple(int(v) for v in ns.size.lower().split("x"))
    runs: dict[str, list[Clock]] = {"headless": [], "dashboard": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.repeats):
            # Alternate, so drift in the machine's load hits both rows alike.
            runs["headless"].append(headless(ns.steps, f"{tmp}/h{i}"))
            runs["dashboard"].append(with_dashboard(ns.steps, f"{tmp}/d{i}", size))
    rate = {name: [c.steps / c.wall for c in clocks] for name, clocks in runs.items()}
    cpu = {name: [c.cpu / c.steps * 1000 for c in clocks] for name, clocks in runs.items()}
    base_rate = statistics.median(rate["headless"])
    base_cpu = statistics.median(cpu["headless"])
    pairs = [d / h for h, d in zip(rate["headless"], rate["dashboard"])]
    print(f"tiny-gpt demo model, {ns.steps} steps x {ns.repeats} repeats, dashboard {size[0]}x{size[1]} (medians)")
    print(f"{'runner':<12} {'steps/s':>9} {'ratio':>7} {'CPU ms/step':>12} {'ratio':>7}   steps/s of each run")
    for name in runs:
        r, c = statistics.median(rate[name]), statistics.median(cpu[name])
        each = " ".join(f"{v:.2f}" for v in rate[name])
        print(f"{name:<12} {r:>9.2f} {r / base_rate:>7.3f} {c:>12.1f} {c / base_cpu:>7.3f}   {each}")
    print(f"median of the paired steps/s ratios (dashboard / headless, run back to back): {statistics.median(pairs):.3f}")
    ui = statistics.median(c.ui_cpu / c.wall * 100 for c in runs["dashboard"])
    print(f"the dashboard's own thread (polling, charts, rendering): {ui:.1f}% of one core while training")


if __name__ == "__main__":
    main()
