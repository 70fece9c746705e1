"""Driving the terminal dashboard with Pilot over a real tiny run: TinyGPT (one layer,
32-dim embeddings) on the python-source data in the Session's background thread."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from workbench import Session, Trainer, TrainingArguments
from workbench.data.builtin import builtin_tokenizer, load_builtin_data
from workbench.models import TinyGPT
from workbench.widgets.tui import DashboardApp

from support.steering import BeginSteps
from support.waiting import DEADLINE

_DATA: dict[str, Any] = {}


def _data() -> tuple[Any, Any, Any]:
    if not _DATA:
        train, evals = load_builtin_data("python-source", block_size=32, max_chars=20_000)
        _DATA.update(train=train, evals=evals, tok=builtin_tokenizer("python-source"))
    return _DATA["train"], _DATA["evals"], _DATA["tok"]


def tiny_session(out: Path, **overrides: Any) -> tuple[Session, BeginSteps]:
    """A Session over TinyGPT (1 layer, 32 dims) that would run long enough to steer."""
    train, evals, tok = _data()
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    # Far more steps than any test waits for (an idle machine runs hundreds a second); each
    # test stops the run. Evaluations: eval_on_start only, so the ones a test asks for count.
    options = dict(max_steps=100_000, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                   learning_rate=3e-3, lr_scheduler_type="linear", logging_steps=2, eval_strategy="steps",
                   eval_steps=100_000, eval_on_start=True, save_strategy="no", report_to="none",
                   disable_tqdm=True, seed=1)
    options.update(overrides)
    begins = BeginSteps()
    trainer = Trainer(model=model, args=TrainingArguments(str(out), **options), train_dataset=train,
                      eval_dataset=evals, processing_class=tok, callbacks=[begins])
    return Session(trainer), begins


async def wait_for(pilot, condition, what: str, timeout: float = DEADLINE) -> None:
    """Let the app run until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what} (status {pilot.app.session.status}, step {pilot.app.session.snapshot().step})")
        await pilot.pause(0.05)


async def press(pilot, *keys: str) -> None:
    """Press keys like a user (``App.simulate_key``), without Pilot.press's wait for an idle
    process: with training running in the background the process is never idle, and each
    of Pilot's waits would run into its one-second ceiling."""
    for key in keys:
        pilot.app.simulate_key(key)
        await pilot.pause(0.05)


def drive(session: Session, scenario, size: tuple[int, int] = (100, 32), **app_options: Any) -> DashboardApp:
    """Run ``scenario(app, pilot)`` against a dashboard on ``session``; always stop the run after."""
    app = DashboardApp(session, **app_options)

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: session.status != "idle", "the run to start")
            await scenario(app, pilot)

    try:
        asyncio.run(main())
    finally:
        if session.status not in ("finished", "stopped", "failed", "idle"):
            session.stop(save=False)
        try:
            session.wait(timeout=DEADLINE)
        except Exception:  # noqa: BLE001 - the test's own assertion is what matters
            pass
    return app


def badge(app: DashboardApp) -> str:
    """The status badge's text."""
    return str(app.dashboard.query_one("#badge").content).strip()


def log_text(app: DashboardApp) -> str:
    """Every line the event panel has shown."""
    return "\n".join(app.dashboard.query_one("#events").history)
