"""The headless progress line's ETA (issue 29, item 1): measured at the rate since the first
step ended, so the evaluation before training and the first step's warm-up -- one-offs that
made the demo's first ETA say 6 min for a 4.5 min run -- do not stretch it."""

from __future__ import annotations

import io
import re

from workbench.core.callbacks import TrainerCallback
from workbench.train.callbacks import ProgressCallback

from support.sessions import make_trainer


class FakeClock:
    """Seconds that pass only when the run's callbacks say so: the ETA's arithmetic, exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costs(TrainerCallback):
    """A slow evaluation before training (30 s), a slow first step (20 s), then 1 s a step."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.clock.now += 30.0

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.now += 20.0 if state.global_step == 1 else 1.0


def test_the_eta_leaves_out_the_evaluation_before_training_and_the_warm_up(tmp_path):
    clock = FakeClock()
    trainer = make_trainer(tmp_path / "run", max_steps=101, logging_steps=11, eval_on_start=True,
                           eval_strategy="steps", eval_steps=1000, disable_tqdm=False)
    # The cost callback runs before the printer: a step's time is spent when its line is written.
    trainer.callback_handler.callbacks.insert(0, Costs(clock))
    printer = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ProgressCallback))
    printer.clock, printer.stream = clock, io.StringIO()
    trainer.train()
    lines = [line for line in printer.stream.getvalue().splitlines() if line.startswith("step 11/101")]
    assert lines, printer.stream.getvalue()
    # 90 steps left at 1 s each: 1:30 (the elapsed-time rule gave (30 + 20 + 10) / 11 * 90 = 8:10).
    assert re.search(r"ETA 1:30\b", lines[0]), lines[0]
