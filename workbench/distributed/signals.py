"""One way to stop and save: signals, Ctrl-C and UI commands all set a ``StopRequest``
(core/stop.py); the ``StopGate`` turns the run's stop decision into ``should_save`` +
``should_training_stop`` at the next safe point (the start or end of a step, or an
evaluation batch), once per run. It is the last of the loop's gates (core/run.py), so a
stop the ranks agreed on in the gate before it is acted on at the same point.

Signal handlers can only be installed from the main thread, so whoever owns the main
thread (the CLI, the Session, ``Trainer.train`` when called there) installs them and the
training thread only polls a flag: no work happens inside a signal handler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable

from workbench.core.run import Gate, Run
from workbench.core.stop import StopRequest

__all__ = ["StopGate", "install_stop_handlers"]


class StopGate(Gate):
    """Saves and stops at the next safe point once the run's stop decision is set; saves once."""

    def __init__(self) -> None:
        self._acted = False

    def train_begin(self, run: Run) -> None:
        self._acted = False

    def act(self, run: Run) -> None:
        """Turn a set decision into save + stop flags, once per run."""
        request = run.stop_decision
        if self._acted or not request.is_set():
            return
        self._acted = True
        run.control.should_training_stop = True
        if request.save:
            run.control.should_save = True

    step_start = act  # a request that came between steps: stop before the next one
    step_end = act
    evaluation_point = act


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
