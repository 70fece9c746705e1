"""``workbench ctl OUTDIR fork | keep | save_variant | discard``: A/B forks from a shell (issue
28), for a person or an agent that steers with ``ctl``. The variants are typed as in the
dashboard's fork screen, one argument each (``a:`` ``"b: learning_rate=1e-3"``); the report
is printed as the fork screen's table, in the same words (widgets/fork_view.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.control.client import RemoteSession

__all__ = ["FORK_USAGE", "run_fork_command", "fork_text"]

FORK_USAGE = "fork STEPS NAME: [KEY=VALUE, ...] ... (e.g. fork 50 a: 'b: learning_rate=1e-3')"


def run_fork_command(session: RemoteSession, action: str, values: list[str], reason: str | None,
                     target: str) -> Any:
    """Send ``fork``, ``keep``, ``save_variant`` or ``discard`` with its arguments as typed;
    ValueError with the usage line on a malformed one (the run checks the rest)."""
    from workbench.widgets.fork_view import parse_variants

    if action == "fork":
        if len(values) < 2 or not values[0].isdigit():
            raise ValueError(f"usage: {FORK_USAGE}")
        return session.fork(parse_variants("\n".join(values[1:])), int(values[0]))
    if action == "keep":
        if len(values) != 1:
            raise ValueError("usage: keep NAME (a variant of the fork; workbench ctl OUTDIR fork ... lists them)")
        return session.keep(values[0], reason=reason)
    if action == "save_variant":
        if len(values) not in (1, 2):
            raise ValueError("usage: save_variant NAME [FOLDER] (a new or empty folder; default OUTDIR-forkN-NAME)")
        folder = values[1] if len(values) == 2 else None
        if folder is not None and Path(target).is_dir():  # same filesystem as the run: the folder as typed here
            folder = str(Path(folder).resolve())
        return {"variant": values[0], "checkpoint": session.save_variant(values[0], folder, reason=reason)}
    if action == "discard":
        session.discard()
        return {"discarded": True}
    raise ValueError(f"not a fork command: {action}")


def fork_text(action: str, result: Any, target: str) -> str:
    """What ``ctl`` prints for a fork command's reply (``--json`` prints the reply itself)."""
    from workbench.widgets.fork_view import fork_metrics, fork_rows, fork_summary

    if action == "fork":
        metrics = fork_metrics(result)
        head = ["variant", "changes", "train loss", *metrics, "same batches"]
        rows = [[row["name"], row["changes"], row["loss"], *row["metrics"], row["same"]] for row in fork_rows(result)]
        widths = [max(len(str(cell)) for cell in column) for column in zip(head, *rows)]
        lines = [fork_summary(result)]
        lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip()
                  for line in (head, *rows)]
        lines.append(f"then: workbench ctl {target} keep NAME | save_variant NAME [FOLDER] | discard")
        return "\n".join(lines)
    if action == "keep":
        return f"kept: {result.get('reason', '')}; the run is paused at step {result.get('step')} (resume continues)"
    if action == "save_variant":
        return (f"saved variant {result['variant']}: {result['checkpoint']} (the fork stays open: keep, save another "
                f"or discard; a run resumed from it goes on as the kept variant would)")
    return "discarded: the run goes on from the pause unchanged (resume continues)"
