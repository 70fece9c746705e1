"""A closed terminal loses no work: SIGHUP, or a terminal found gone, stops the run as SIGTERM
does (a checkpoint at the next safe point, then the run's ``end`` record), and ``workbench
run`` exits 129 (128 + SIGHUP), leaving neither ``.lock`` nor ``control.json`` behind.

Why a thread of its own: once a terminal hangs up, every write to it fails (EIO) and every
read returns end-of-file at once. A print of the run would then fail the run, so the dead
descriptors are pointed at /dev/null first. Under the dashboard, Textual's writer thread dies
on its first failed write and its input thread spins on the end-of-file, so the app's event
loop can block for good on a full output queue, where no handler of its own would run (and
the terminal may be gone without this process ever getting the SIGHUP: only its parent did).
The signal handler therefore only sets an event; this module's watcher thread, started
before the run, notices the event or the dead terminal, stops the run, and under a dashboard
waits for the run's checkpoint and end record, releases what the run holds and leaves with
``os._exit`` without touching the terminal again.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Callable

from workbench.core.exit_codes import EXIT_HANGUP

__all__ = ["HangupWatch", "terminal_gone"]

_POLL_S = 0.5  # how often the watcher looks at the terminal


def terminal_gone(fd: int) -> bool:
    """Whether ``fd`` is a terminal that has hung up: still a character device, but no longer
    a tty (its I/O fails with EIO). A file, a pipe or /dev/null is never "gone"."""
    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode) and not os.isatty(fd) and os.path.realpath(
            f"/proc/self/fd/{fd}") != os.devnull
    except OSError:
        return False


class HangupWatch:
    """Watch for SIGHUP and for the process's terminal going away; then ``stop()`` the run.

    ``finish``: what follows the stop when the terminal is gone and the main thread cannot be
    trusted to return (the dashboard's): it waits for the run to end and releases what the run
    holds; the process then exits with :data:`EXIT_HANGUP`. Otherwise (a headless run, trained
    in the main thread; a SIGHUP sent by hand to a dashboard whose terminal still works) the
    main thread ends the run as for any stop, and :attr:`hung_up` says why.
    """

    def __init__(self, stop: Callable[[], object], finish: Callable[[], object] | None = None,
                 fds: tuple[int, ...] = (0, 1, 2)) -> None:
        self._stop, self._finish = stop, finish
        self._ttys = [fd for fd in fds if _is_tty(fd)]  # only a terminal we had can go away
        self._event = threading.Event()
        self._closed = threading.Event()
        self._previous = None
        self.hung_up = False

    def __enter__(self) -> "HangupWatch":
        self._previous = signal.signal(signal.SIGHUP, self._on_signal)
        threading.Thread(target=self._watch, name="workbench-hangup", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Silenced here too, at once: the main thread may be about to print (a headless run).
        _silence([fd for fd in self._ttys if not _is_tty(fd)])
        self._event.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            if self._event.wait(_POLL_S) or any(terminal_gone(fd) for fd in self._ttys):
                break
        else:
            return
        self.hung_up = True
        dead = [fd for fd in self._ttys if not _is_tty(fd)]
        _silence(dead)
        self._stop()
        if dead and self._finish is not None:
            try:
                self._finish()
            finally:
                os._exit(EXIT_HANGUP)


def _is_tty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _silence(fds: list[int]) -> None:
    """Point the descriptors of a terminal that is gone at /dev/null, so a print (the run's
    progress lines, the last message) neither fails nor blocks."""
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)
