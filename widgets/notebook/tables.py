"""HTML for the panel's text parts: status line, metrics, memory, checkpoints, events, error.

Pure functions from a Snapshot (or parts of it) to an HTML string. Wording and number
formats come from ``workbench.widgets.view`` so the notebook and the terminal dashboard say
the same thing; only the markup is notebook-specific. Colours are semi-transparent or
theme variables, so the tables read on light and dark Jupyter themes alike.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from workbench.door.values import Status
from workbench.door.values import is_timing_metric
from workbench.widgets.view import (
    TERMINAL,
    TRAIN_SERIES,
    SampleBook,
    answer_text,
    describe_event,
    fmt_age,
    fmt_bytes,
    elapsed_text,
    fmt_lr,
    fmt_number,
    intervention_cells,
    lower_is_better,
    memory_rows,
    metric_rows,
    health_line,
    progress_line,
    status_label,
)

__all__ = [
    "STATUS_COLORS",
    "status_html",
    "metrics_html",
    "evaluations_html",
    "memory_html",
    "checkpoints_html",
    "events_html",
    "error_html",
    "notice_html",
    "event_entry",
    "terminal",
    "interventions_html",
    "samples_html",
]

STATUS_COLORS = {
    Status.IDLE: "#888888", Status.RUNNING: "#2e9d4f", Status.PAUSING: "#d68a00", Status.PAUSED: "#d68a00",
    Status.EVALUATING: "#2f7fd1", Status.SAVING: "#2f7fd1", Status.STOPPING: "#d68a00", Status.FINISHED: "#2f7fd1",
    Status.STOPPED: "#888888", Status.FAILED: "#d13b3b",
}
LEVEL_COLORS = {"info": "inherit", "good": "#2e9d4f", "warn": "#d68a00", "error": "#d13b3b"}

_TABLE = ('<table style="border-collapse:collapse;font-size:12px;font-variant-numeric:tabular-nums;'
          'margin:2px 0">')
_TH = '<th style="text-align:{align};padding:2px 10px;border-bottom:1px solid rgba(128,128,128,.5)">'
_TD = '<td style="text-align:{align};padding:2px 10px">'
_BEST_ROW = ' style="background:rgba(46,157,79,.16);font-weight:600"'


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(headers: Sequence[str], rows: Iterable[tuple[Sequence[str], bool]], right_from: int = 1) -> str:
    """An HTML table; rows are (cells, highlighted). Cells are already escaped."""
    out = [_TABLE, "<tr>"]
    out += [_TH.format(align="right" if i >= right_from else "left") + _e(h) + "</th>" for i, h in enumerate(headers)]
    out.append("</tr>")
    for cells, marked in rows:
        out.append(f"<tr{_BEST_ROW if marked else ''}>")
        out += [_TD.format(align="right" if i >= right_from else "left") + c + "</td>" for i, c in enumerate(cells)]
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _muted(text: str) -> str:
    return f'<span style="opacity:.65">{_e(text)}</span>'


def status_html(snapshot: Any) -> str:
    """The status line: badge, progress figures, elapsed time, latest loss and LR, run name."""
    color = STATUS_COLORS.get(snapshot.status, "#888888")
    badge = (f'<span class="wb-status" data-status="{_e(snapshot.status)}" style="background:{color};color:white;'
             f'border-radius:3px;padding:1px 7px;font-weight:600;letter-spacing:.04em">'
             f'{_e(status_label(snapshot.status))}</span>')
    parts = [progress_line(snapshot), elapsed_text(snapshot)]
    loss = snapshot.latest("loss")
    if loss is not None:
        parts.append(f"loss {fmt_number(loss)}")
    lr = snapshot.latest("learning_rate")
    if lr is not None:
        parts.append(f"lr {fmt_lr(lr)}")
    where = " · ".join(x for x in (snapshot.run_name, snapshot.device) if x)
    health = health_line(snapshot)
    warn = health.startswith("HANG")
    health_html = (f'<div class="wb-health" style="{"color:#c00;font-weight:600" if warn else "opacity:.75"}">'
                   f"{_e(health)}</div>" if health else "")
    return (f'<div class="wb-status-line" style="font-size:13px;line-height:1.8">{badge} '
            f'<span class="wb-progress" data-step="{snapshot.step}">{_e(" · ".join(parts))}</span>'
            + (f" {_muted('(' + where + ')')}" if where else "") + health_html + "</div>")


def metrics_html(series: Mapping[str, Sequence[tuple[int, float]]], best_metric: float | None,
                 best_step: int | None) -> str:
    """Per metric: latest and best value with their steps; ★ marks the metric that picks the
    run's best checkpoint (metric_for_best_model), and each row's best value is in bold."""
    rows = metric_rows(series, best_metric, best_step)
    if not rows:
        return _muted("no metrics yet: they appear after the first logging step or evaluation")
    body = []
    for row in rows:
        direction = "lower is better" if lower_is_better(row.name) else "higher is better"
        name = _e(row.name) + (" ★" if row.selects_best else "")
        best = f"<b>{_e(fmt_number(row.best))}</b>" if row.best is not None else "-"
        body.append(([name, _e(fmt_number(row.latest)), _e(row.latest_step if row.latest_step is not None else "-"),
                      best, _e(row.best_step if row.best_step is not None else "-"), _muted(direction)],
                     row.selects_best))
    note = ""
    if best_step is not None:
        note = f"<div>★ best model: step {best_step} (metric {_e(fmt_number(best_metric))})</div>"
    return _table(["metric", "latest", "at step", "best", "at step", ""], body) + note


def evaluations_html(series: Mapping[str, Sequence[tuple[int, float]]], best_step: int | None,
                     limit: int = 12) -> str:
    """One row per evaluation (newest last, at most ``limit`` plus the best), best row marked ★.

    Without a metric_for_best_model the best evaluation is the one with the lowest eval_loss.
    """
    names = sorted((k for k in series if k not in TRAIN_SERIES and series[k]), key=lambda k: (k != "eval_loss", k))
    if not names:
        return ""
    table: dict[int, dict[str, float]] = {}
    for name in names:
        for step, value in series[name]:
            table.setdefault(step, {})[name] = value
    steps = sorted(table)
    marked = best_step
    if marked is None and "eval_loss" in names:
        finite = [(v, s) for s, v in series["eval_loss"] if math.isfinite(v)]
        marked = min(finite)[1] if finite else None
    shown = steps[-limit:]
    if marked is not None and marked in table and marked not in shown:
        shown = [marked, *shown]
    body = [([_e(step) + (" ★" if step == marked else ""), *(_e(fmt_number(table[step].get(n))) for n in names)],
             step == marked) for step in shown]
    return _table(["step", *names], body)


def memory_html(report: Any) -> str:
    """The memory table: model tensors (parameters, gradients, optimizer state), device and host."""
    rows = memory_rows(report)
    if not rows:
        return _muted("no memory reading yet (the first one is taken during the first steps)")
    body = []
    for row in rows:
        share = ""
        if row.value is not None and row.scale:
            share = f"{100.0 * row.value / row.scale:.0f}%"
        body.append(([_e(row.label), _e(fmt_bytes(row.value)) if row.value is not None else "-", _e(share),
                      _e(fmt_bytes(row.peak)) if row.peak is not None else "-", _muted(row.note)], False))
    return _table(["memory", "now", "share", "peak", ""], body)


def _key_metrics(metrics: Mapping[str, Any]) -> str:
    shown = sorted(((k, v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                    and not is_timing_metric(k) and k != "epoch"),
                   key=lambda kv: (kv[0] != "eval_loss", kv[0]))[:3]
    return " ".join(f"{k.removeprefix('eval_')}={fmt_number(float(v))}" for k, v in shown) or "-"


def checkpoints_html(checkpoints: Sequence[Any], now: float | None = None) -> str:
    """The checkpoint catalog: name, step, epoch, key metrics, size, age, state; best ★, kept 🔒."""
    if not checkpoints:
        return _muted("no checkpoints yet: Save writes one now")
    now = time.time() if now is None else now
    body = []
    for c in checkpoints:
        state = "complete" if c.complete else "incomplete"
        if getattr(c, "problem", None):
            state += f" ({c.problem})"
        flags = ("★ best " if c.best else "") + ("🔒" if c.protected else "")
        epoch = f"{c.epoch:.2f}" if c.epoch is not None else "-"
        body.append(([_e(c.name), _e(c.step), _e(epoch), _e(_key_metrics(c.metrics)), _e(fmt_bytes(c.size)),
                      _e(fmt_age(c.created, now)), _e(state), _e(flags.strip())], bool(c.best)))
    return _table(["checkpoint", "step", "epoch", "metrics", "size", "created", "state", ""], body)


def events_html(entries: Sequence[tuple[float, str, str]]) -> str:
    """The newest events and panel notices, newest first: (unix time, level, text)."""
    if not entries:
        return _muted("no events yet")
    lines = []
    for when, level, text in reversed(entries):
        clock = time.strftime("%H:%M:%S", time.localtime(when))
        lines.append(f'<div style="color:{LEVEL_COLORS.get(level, "inherit")}">'
                     f'<span style="opacity:.6">{clock}</span> {_e(text)}</div>')
    return '<div style="font-size:12px;font-family:var(--jp-code-font-family,monospace)">' + "".join(lines) + "</div>"


def event_entry(event: Any) -> tuple[float, str, str] | None:
    """A SessionEvent as an event-log entry, or None when it would only be noise (loss logs)."""
    described = describe_event(event.kind, event.step, event.data)
    if described is None:
        return None
    return (event.time, *described)


def interventions_html(interventions: Sequence[Any], colors: Mapping[str, str]) -> str:
    """The guard's interventions, newest first: step, kind (in its chart colour), action,
    loss (> threshold for a spike) and the step's dataset rows."""
    if not interventions:
        return _muted("no interventions: the guard has not acted (or is off)")
    rows = []
    for item in reversed(interventions):
        step, kind, action, value, samples = intervention_cells(item, sample_limit=16)
        color = colors.get(item.kind, "inherit")
        rows.append(([_e(step), f'<span style="color:{color};font-weight:600">{_e(kind)}</span>', _e(action),
                      _e(value), _e(samples)], False))
    return _table(["step", "kind", "action", "loss", "samples"], rows, right_from=5)


def samples_html(book: SampleBook, limit: int = 2000) -> str:
    """The run's samples: each prompt, then its answers newest first with the step whose
    weights gave them (line breaks kept; an answer cut at ``limit`` characters)."""
    prompts = book.prompts()
    if not prompts:
        return _muted("no samples: a run samples with [samples] in its config or SamplesCallback(prompts=[...])")
    out = []
    for prompt, answers in prompts:
        out.append(f'<div class="wb-sample-prompt" style="font-weight:600;margin:6px 0 2px">{_e(prompt)}</div>')
        rows = []
        for a in answers:
            text = a.answer if a.answer.strip() else answer_text(a.answer)
            text = text if len(text) <= limit else text[:limit - 1] + "…"
            rows.append(([_e(a.step), f'<span style="white-space:pre-wrap">{_e(text)}</span>',
                          _e(a.tokens if a.tokens is not None else "-")], False))
        out.append(_table(["step", "answer", "tokens"], rows, right_from=2))
    return '<div class="wb-samples" style="font-size:12px">' + "".join(out) + "</div>"


def error_html(message: str | None, trace_text: str | None = None) -> str:
    """The error area of a failed run: the exception line, and its traceback (text, from the
    snapshot) folded away."""
    if not message:
        return ""
    trace = ""
    if trace_text:
        trace = (f"<details><summary>traceback</summary><pre style=\"font-size:11px;white-space:pre-wrap\">"
                 f"{_e(trace_text)}</pre></details>")
    return (f'<div class="wb-error" style="border-left:4px solid #d13b3b;background:rgba(209,59,59,.1);'
            f'padding:4px 10px;margin:4px 0"><b>Training failed</b>: {_e(message)}{trace}</div>')


def notice_html(level: str, text: str) -> str:
    """A one-line answer to the last button press (what happened, or why it was refused)."""
    if not text:
        return ""
    color = LEVEL_COLORS.get(level, "inherit")
    return f'<span class="wb-notice" data-level="{_e(level)}" style="color:{color}">{_e(text)}</span>'


def terminal(status: str) -> bool:
    """Whether ``status`` means the run's thread has ended."""
    return status in TERMINAL
