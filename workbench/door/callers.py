"""Who calls a run's command, so that a refusal names a way that caller can act.

A Session is called by Python in its own process (a script, a notebook) and, through its
control endpoint, by ``workbench ctl``, an attached dashboard and scripts over
``workbench.attach``. A refusal that says "pause it first (session.pause(wait=True))"
helps the first and leaves someone at a command line without a way; one that says
"workbench ctl runs/x pause --wait" helps the second. The control server runs each
command with the client's name set here (a context variable: set in the thread that calls
the Session, seen by nothing else); a dashboard in the run's own process sets its own.
Everything else is Python. Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["calling_as", "caller", "for_caller", "PEOPLE"]

# The callers that are people at a terminal (a control client's hello name, or the local
# dashboard): they act with the CLI or the dashboard's keys, not with Python.
PEOPLE = frozenset({"ctl", "attach", "dashboard"})

_CALLER: ContextVar[str | None] = ContextVar("workbench_caller", default=None)


@contextlib.contextmanager
def calling_as(who: str | None) -> Iterator[None]:
    """Run the body as ``who`` (a control client's name: "ctl", "attach", "remote"; or
    "dashboard"): a refusal raised in it is worded for that caller."""
    token = _CALLER.set(who)
    try:
        yield
    finally:
        _CALLER.reset(token)


def caller() -> str | None:
    """Who calls now: a name given to calling_as(), or None for Python in the run's process."""
    return _CALLER.get()


def for_caller(python: str, person: str) -> str:
    """``person`` (CLI commands, dashboard keys) when a person at a terminal calls, else
    ``python`` (a script over ``workbench.attach`` calls the same methods as in-process Python)."""
    return person if caller() in PEOPLE else python
