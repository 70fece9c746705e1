"""One way to stop and save: signals, Ctrl-C and UI commands all set a ``StopRequest``;
``JITCheckpointCallback`` turns it into ``should_save`` + ``should_training_stop`` at the
next safe point (end of the current step, or the current evaluation batch).

Signal handlers can only be installed from the main thread, so whoever owns the main
thread (the CLI, the Session, ``Trainer.train`` when called there) installs them and the
training thread only polls a flag: no work happens inside a signal handler.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable

from workbench.train.callbacks import TrainerCallback

__all__ = ["StopRequest", "JITCheckpointCallback", "install_stop_handlers"]


class StopRequest:
    """A thread-safe "stop and save" flag that remembers why it was set (first reason wins)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.save = True
        self.set_at: float | None = None  # time.monotonic() of the request

    def set(self, reason: str, save: bool = True) -> bool:
        """Request a stop; returns False when one was already requested (nothing changes)."""
        with self._lock:
            if self._event.is_set():
                return False
            self.reason, self.save = reason, save
            self.set_at = time.monotonic()
            self._event.set()
            return True

    def is_set(self) -> bool:
        """Whether a stop was requested."""
        return self._event.is_set()

    def clear(self) -> None:
        """Forget a request (a new run in the same process)."""
        with self._lock:
            self._event.clear()
            self.reason = None
            self.save = True
            self.set_at = None


class JITCheckpointCallback(TrainerCallback):
    """Saves and stops at the next safe point once the StopRequest is set; saves once."""

    def __init__(self, request: StopRequest) -> None:
        self.request = request
        self._acted = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._acted = False

    def act(self, control) -> None:
        """Turn a set request into save + stop flags, once per run."""
        if self._acted or not self.request.is_set():
            return
        self._acted = True
        control.should_training_stop = True
        if self.request.save:
            control.should_save = True

    def on_step_begin(self, args, state, control, **kwargs):
        self.act(control)  # a request that came between steps: stop before the next one

    def on_step_end(self, args, state, control, **kwargs):
        self.act(control)

    def on_prediction_step(self, args, state, control, **kwargs):
        self.act(control)

    def on_evaluate(self, args, state, control, **kwargs):
        self.act(control)


def install_stop_handlers(
    request: StopRequest,
    signals: Iterable[int] = (signal.SIGTERM,),
    on_repeat: Callable[[int], None] | None = None,
) -> Callable[[], None]:
    """Route ``signals`` to ``request`` (main thread only); returns a function restoring the old handlers.

    A repeated signal after the request calls ``on_repeat(signum)`` (the CLI aborts on a
    second Ctrl-C); by default repeats are ignored, so a second SIGTERM never starts a
    second save.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("signal handlers can only be installed from the main thread")
    names = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
    if hasattr(signal, "SIGUSR1"):
        names[signal.SIGUSR1] = "SIGUSR1"

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        if not request.set(names.get(signum, f"signal {signum}")) and on_repeat is not None:
            on_repeat(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
