"""The ``workbench checkpoints OUTDIR`` table: every checkpoint checked against its manifest.

The catalog (``CheckpointStore.list``) only reads small JSON files, so a checkpoint whose
weights were damaged after sealing looks as complete there as a good one. This listing
verifies each sealed checkpoint before it says anything about it: sha256 of every file by
default, sizes only with ``quick`` (and then it says the hashes were not checked).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from workbench.checkpoint.storage_errors import human_size
from workbench.checkpoint.store import CheckpointStore
from workbench.core.records import CheckpointRow, is_timing_metric

__all__ = ["verified_rows", "row_state", "table_lines", "json_rows", "reseal_lines"]

QUICK_STATE = "sizes ok (hashes not checked)"


def verified_rows(store: CheckpointStore, quick: bool = False) -> list[CheckpointRow]:
    """The catalog with each sealed checkpoint verified: ``verified`` True or False (then
    ``problem`` says which file differs and how), None where there is nothing to check
    against (no manifest). A damaged checkpoint is not ``complete``: no resume takes it."""
    rows = []
    for row in store.list():
        if row.complete:
            try:
                ok, why = store.verify(row.path, hashes=not quick)
            except OSError as exc:  # a file that cannot be read is as good as damaged
                ok, why = False, f"cannot be read ({exc.strerror or exc}: {exc.filename or row.path})"
            row = replace(row, verified=ok, complete=ok, problem=None if ok else why)
        rows.append(row)
    return rows


def row_state(row: CheckpointRow, quick: bool = False) -> str:
    """The state column: verified, sizes ok (hashes not checked), DAMAGED, incomplete, ..."""
    if row.verified is True:
        return QUICK_STATE if quick else "verified"
    if row.verified is False:
        return "DAMAGED"
    if row.foreign:
        return "unsealed (HF)"
    if row.problem:
        return "unreadable"
    return "incomplete"


def table_lines(rows: list[CheckpointRow], quick: bool = False) -> list[str]:
    """The printed table, then one line per damaged or unreadable checkpoint saying why."""
    import time

    states = [row_state(r, quick) for r in rows]
    width = max([10, *map(len, states)])
    lines = [f"{'name':<20} {'step':>7} {'epoch':>6} {'size':>9} {'created':<19} {'state':<{width}} metrics"]
    for r, state in zip(rows, states):
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)) if r.created else "-"
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()) if not is_timing_metric(k))
        epoch = f"{r.epoch:.2f}" if r.epoch is not None else "-"
        marker = " *best" if r.best else ""
        lines.append(f"{r.name:<20} {r.step:>7} {epoch:>6} {human_size(r.size):>9} {created:<19} "
                     f"{state:<{width}} {metrics}{marker}".rstrip())
    for r in rows:
        if r.problem:
            lines.append(f"{r.name}: {r.problem}")
    return lines


def json_rows(rows: list[CheckpointRow], quick: bool = False) -> list[dict[str, Any]]:
    """The rows for ``--json``: each row's fields, its ``state`` and whether hashes were checked."""
    return [{**r.to_dict(), "state": row_state(r, quick), "hashes_checked": r.verified is not None and not quick}
            for r in rows]


def reseal_lines(store: CheckpointStore, name: str) -> list[str]:
    """``--reseal NAME``: accept checkpoint NAME's files as they are now; the lines say what
    differed from its manifest. ValueError (one line) for a name that is no checkpoint."""
    folder = store.root / name
    if not folder.is_dir():
        names = ", ".join(row.name for row in store.list()) or "none"
        raise ValueError(f"{folder} does not exist; checkpoints in {store.root}: {names}")
    changed = store.reseal(folder)
    return [f"{rel}: {what}" for rel, what in changed] + [
        f"resealed {folder}: {len(changed)} difference(s) accepted" if changed
        else f"resealed {folder}: its files already matched the manifest"]
