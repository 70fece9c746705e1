"""Counting host syncs: every call that makes the host wait for the device, made by the
training thread inside the steps that do not log."""

from __future__ import annotations

import threading

import torch

from workbench import Trainer, TrainerCallback

from support.lm import lm_trainer

SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


class SyncCounter:
    """Counts host-sync calls made by the training thread between on_step_begin and
    on_step_end of steps that do not log (evaluation and saving are off)."""

    def __init__(self, monkeypatch) -> None:
        self.in_window = 0
        self.total = 0
        self.where: list[str] = []
        self.active = False
        self.thread: threading.Thread | None = None
        self.windows = 0
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        counter = self

        def wrapper(self, *args, **kwargs):
            if threading.current_thread() is counter.thread:
                counter.total += 1
                if counter.active:
                    counter.in_window += 1
                    import traceback

                    frame = traceback.extract_stack(limit=2)[0]
                    counter.where.append(f"{name} at {frame.filename}:{frame.lineno}")
            return original(self, *args, **kwargs)

        return wrapper

    def callbacks(self) -> tuple[TrainerCallback, TrainerCallback]:
        counter = self

        class Begin(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                counter.thread = threading.current_thread()

            def on_step_begin(self, args, state, control, **kwargs):
                nxt = state.global_step + 1
                logs = nxt % state.logging_steps == 0 or nxt >= state.max_steps or (nxt == 1 and args.logging_first_step)
                if not logs:
                    counter.active = True
                    counter.windows += 1

        class End(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                counter.active = False

        return Begin(), End()


def sync_trainer(out, counter: SyncCounter) -> tuple[Trainer, TrainerCallback]:
    """A 20-step run that logs at steps 10 and 20, counted by ``counter``; add the returned
    end callback last so the window closes after every other callback ran."""
    begin, end = counter.callbacks()
    trainer = lm_trainer(out, max_steps=20, logging_steps=10, callbacks=[begin])
    return trainer, end
