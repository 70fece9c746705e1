"""What the checkpoints screen says about one checkpoint: metrics, live edits, config diffs.

Reads the checkpoint's own small JSON files (trainer_state.json, training_args.json), so
the detail pane shows what a resume from it would really start from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.markup import escape

from workbench.door.values import edit_changes, is_timing_metric
from workbench.widgets.view import edit_text, fmt_bytes, fmt_number

__all__ = ["checkpoint_details", "config_differences", "key_metrics"]

# Arguments that differ between any two runs without changing what is trained.
_NOISE = {"logging_dir", "run_name", "output_dir"}


def key_metrics(rows: list[Any], limit: int = 2) -> list[str]:
    """The metric columns of the catalog: eval_loss first, then the other eval metrics by name."""
    names = {k for r in rows for k, v in r.metrics.items()
             if isinstance(v, (int, float)) and not is_timing_metric(k)}
    return sorted(names, key=lambda k: (k != "eval_loss", k))[:limit]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, value in the checkpoint, value in the current run) for every argument that differs."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in _NOISE:
            continue
        a, b = saved.get(key), current.get(key)
        if a != b:
            out.append((key, a, b))
    return out


def _value(v: Any) -> str:
    return fmt_number(v) if isinstance(v, float) else str(v)


def checkpoint_details(info: Any, current_args: dict[str, Any] | None) -> list[str]:
    """Lines (Textual markup) describing checkpoint ``info`` against the current run's arguments."""
    path = Path(info.path)
    lines = [f"[b]{info.name}[/b]  step {info.step}"
             + (f"  epoch {info.epoch:.2f}" if info.epoch is not None else "")
             + f"  {fmt_bytes(info.size)}"]
    flags = []
    if info.best:
        flags.append("[yellow]★ best[/]")
    if info.protected:
        flags.append("protected")
    flags.append("[green]complete[/]" if info.complete else "[red]incomplete[/]")
    lines.append("  ".join(flags))
    if info.problem:
        lines.append(f"[red]{info.problem}[/]")

    metrics = {k: v for k, v in info.metrics.items() if not is_timing_metric(k)}
    lines.append("")
    lines.append("[b]metrics[/b]")
    lines += [f"  {k} = {fmt_number(v)}" for k, v in sorted(metrics.items())] or ["  (no evaluation at this step)"]

    edits = info.edits
    lines.append("")
    lines.append("[b]live edits[/b]")
    for edit in edits:
        changes = ", ".join(f"{k}={edit_text(k, v)}" for k, v in edit_changes(edit).items())
        why = f" [dim]({escape(str(edit['reason']))})[/]" if edit.get("reason") else ""
        lines.append(f"  step {edit.get('step', '?')}: {changes}{why}")
    if not edits:
        lines.append("  (none)")
    earlier = getattr(info, "edit_count", len(edits)) - len(edits)
    if earlier > 0:
        lines.append(f"  [dim]({earlier} earlier edits: the checkpoint's trainer_state.json lists them all)[/]")

    saved_args = _read_json(path / "training_args.json")
    lines.append("")
    lines.append("[b]config vs current run[/b]")
    if saved_args is None or current_args is None:
        lines.append("  (training_args.json unreadable)")
    else:
        diffs = config_differences(saved_args, current_args)
        lines += [f"  {k}: {_value(a)} → {_value(b)}" for k, a, b in diffs] or ["  (same arguments)"]
    return lines
