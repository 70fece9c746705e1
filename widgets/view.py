"""Formatting shared by the front-ends (terminal dashboard, notebook panel).

Everything here is pure: numbers, durations, byte sizes, series downsampling and the
wording of events and summaries, computed from a ``Snapshot`` or ``SessionEvent``. Keeping
it free of any UI library means both front-ends say the same thing in the same words, and
it can be tested without a terminal or a browser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.door.values import ENDED, Status
from workbench.door.values import is_timing_metric

__all__ = [
    "TERMINAL",
    "TRAIN_SERIES",
    "Point",
    "MetricRow",
    "MemoryRow",
    "fmt_number",
    "fmt_lr",
    "fmt_duration",
    "fmt_clock",
    "fmt_bytes",
    "fmt_rate",
    "fmt_age",
    "status_label",
    "downsample",
    "smooth",
    "lower_is_better",
    "metric_rows",
    "memory_rows",
    "describe_event",
    "summary_lines",
    "progress_line",
    "GUARD_COLORS",
    "intervention_cells",
    "describe_intervention",
]

Point = tuple[int, float]

# Series names the dashboard charts itself; everything else from an evaluation is a metric.
TRAIN_SERIES = ("loss", "learning_rate", "grad_norm")
TERMINAL = ENDED  # the statuses of a run that has ended (the session layer's one definition)


# -- numbers --------------------------------------------------------------------------------


def fmt_number(value: float | int | None, digits: int = 4) -> str:
    """A metric value in ``digits`` significant digits ("-" when missing, "nan"/"inf" kept
    visible, because a diverged loss is exactly what the user must see)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def fmt_lr(value: float | None) -> str:
    """A learning rate in scientific notation (rates span decades, so fixed digits mislead)."""
    if value is None:
        return "-"
    return f"{value:.2e}"


def fmt_duration(seconds: float | None) -> str:
    """A compact duration for ETAs and ages: "45s", "3m 04s", "1h 02m", "2d 03h"."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def fmt_clock(seconds: float | None) -> str:
    """Elapsed time as H:MM:SS (a steadily ticking clock reads better than "3m 04s")."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def fmt_bytes(n: int | float | None) -> str:
    """A byte count with a binary unit ("1.5 MB" means 1.5 * 1024**2), as the CLI prints sizes."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def fmt_rate(value: float | None, unit: str) -> str:
    """A throughput such as "1.2k samples/s"; "-" before the first steps are timed."""
    if not value:
        return f"- {unit}/s"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix} {unit}/s"
    return f"{value:.1f} {unit}/s"


def fmt_age(created: float | None, now: float) -> str:
    """How long ago a checkpoint was written ("3m 04s ago")."""
    if created is None:
        return "-"
    return f"{fmt_duration(max(now - created, 0.0))} ago"


def status_label(status: str) -> str:
    """The status badge text: upper case so it stands out in a capture or a glance."""
    return status.upper()


# -- series ---------------------------------------------------------------------------------


def downsample(points: Sequence[Point], max_points: int) -> list[Point]:
    """At most about ``max_points`` points that still show every spike.

    A chart a few dozen cells wide cannot show thousands of points; plain striding would
    hide a loss spike, so each bucket keeps its minimum and its maximum (in step order),
    and the first and last points always survive.
    """
    n = len(points)
    if max_points <= 0 or n <= max_points:
        return list(points)
    buckets = max(max_points // 2, 1)
    size = n / buckets
    out: list[Point] = []
    for b in range(buckets):
        chunk = points[int(b * size): max(int((b + 1) * size), int(b * size) + 1)]
        if not chunk:
            continue
        lo = min(chunk, key=lambda p: p[1])
        hi = max(chunk, key=lambda p: p[1])
        out.extend(sorted({lo, hi}, key=lambda p: p[0]))
    if out[0] != points[0]:
        out.insert(0, points[0])
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def smooth(points: Sequence[Point], weight: float = 0.8) -> list[Point]:
    """An exponential moving average, debiased like TensorBoard's, so the first values are
    not pulled towards zero. NaN/inf values pass through unsmoothed (they must stay visible)."""
    out: list[Point] = []
    avg = 0.0
    count = 0
    for step, value in points:
        if not math.isfinite(value):
            out.append((step, value))
            continue
        count += 1
        avg = weight * avg + (1 - weight) * value
        out.append((step, avg / (1 - weight**count)))
    return out


# -- metrics --------------------------------------------------------------------------------


def lower_is_better(name: str) -> bool:
    """Guess a metric's direction from its name: losses, perplexities and errors go down."""
    lowered = name.lower()
    return any(word in lowered for word in ("loss", "perplexity", "ppl", "error", "wer", "cer", "mse", "mae"))


@dataclass(frozen=True)
class MetricRow:
    """One line of the metrics table: the newest and the best value of an evaluation metric."""

    name: str
    latest: float | None
    latest_step: int | None
    best: float | None
    best_step: int | None
    selects_best: bool  # this is the metric the run's best checkpoint is chosen by


def _best_point(points: Sequence[Point], lower: bool) -> Point | None:
    finite = [p for p in points if math.isfinite(p[1])]
    if not finite:
        return None
    return (min if lower else max)(finite, key=lambda p: p[1])


def metric_rows(series: dict[str, Sequence[Point]], best_metric: float | None = None,
                best_step: int | None = None) -> list[MetricRow]:
    """Rows for every evaluation metric (eval_loss first), plus the training loss.

    The run's own best (``best_metric`` at ``best_step``, from metric_for_best_model) marks
    the metric it was chosen by; for the others the best is the minimum or maximum by name.
    """
    names = sorted((k for k in series if k not in TRAIN_SERIES and series[k]),
                   key=lambda k: (k != "eval_loss", k))
    rows = []
    for name in [*names, *(["loss"] if series.get("loss") else [])]:
        points = series[name]
        selects = False
        if best_metric is not None and best_step is not None and name != "loss":
            selects = any(s == best_step and math.isclose(v, best_metric, rel_tol=1e-9, abs_tol=1e-12)
                          for s, v in points)
        if selects:
            best: Point | None = (best_step, best_metric)
        else:
            best = _best_point(points, lower_is_better(name))
        rows.append(MetricRow(name, points[-1][1], points[-1][0], best[1] if best else None,
                              best[0] if best else None, selects))
    return rows


# -- memory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRow:
    """One memory bar: ``value`` out of ``scale`` (the bar's full width), with an optional peak."""

    label: str
    value: int | None
    scale: int | None
    peak: int | None = None
    note: str = ""


def memory_rows(report: Any) -> list[MemoryRow]:
    """Bars for a ``MemoryUsage`` (workbench.door.values).

    The model's own tensors (parameters, gradients, optimizer state) are drawn against
    their sum, so their proportions show; device and host use are drawn against their
    peaks. Activations are not counted per tensor: on devices with allocator counters they
    are estimated as the peak minus the model's tensors, elsewhere shown as unknown.
    """
    if report is None:
        return []
    model_total = report.parameters + report.gradients + report.optimizer_state
    rows = [
        MemoryRow("params", report.parameters, model_total),
        MemoryRow("grads", report.gradients, model_total),
        MemoryRow("optim", report.optimizer_state, model_total),
    ]
    if report.device_peak is not None:
        activations = max(report.device_peak - model_total, 0)
        rows.append(MemoryRow("activ.", activations, report.device_peak, note="est."))
    else:
        rows.append(MemoryRow("activ.", None, None, note="n/a on " + report.device_type))
    if report.device_allocated is not None:
        top = report.device_peak or report.device_reserved or report.device_allocated
        rows.append(MemoryRow(report.device_type, report.device_allocated, top, peak=report.device_peak))
    rows.append(MemoryRow("host", report.host_rss, report.host_peak, peak=report.host_peak))
    return rows


# -- events and summaries ----------------------------------------------------------------------


def _metrics_text(data: dict[str, Any], limit: int = 3) -> str:
    shown = [(k, v) for k, v in data.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)
             and not is_timing_metric(k) and "_mem_" not in k and k != "epoch"]
    shown.sort(key=lambda kv: (kv[0] != "eval_loss", kv[0]))
    return " ".join(f"{_short(k)}={fmt_number(v)}" for k, v in shown[:limit])


def _short(name: str) -> str:
    """eval_accuracy -> accuracy; eval_loss keeps its prefix (it is not the train loss)."""
    return name if name == "eval_loss" else name.removeprefix("eval_")


def describe_event(kind: str, step: int, data: dict[str, Any]) -> tuple[str, str] | None:
    """(level, text) for the event log, or None for events that would only be noise.

    Levels: "info", "good" (saves, finishing), "warn" (non-finite losses, stops) and
    "error". Regular loss logs are left to the charts, except when the loss stops being a
    finite number, which is the one log line a user must not miss.
    """
    if kind == "logged":
        loss = data.get("loss")
        if isinstance(loss, float) and not math.isfinite(loss):
            return "warn", f"step {step}: loss is {loss}"
        return None
    if kind == "evaluated":
        return "info", f"step {step}: {_metrics_text(data) or 'evaluated'}"
    if kind == "saved":
        return "good", f"step {step}: saved {Path(str(data.get('checkpoint', ''))).name}"
    if kind == "paused":
        return "warn", f"step {step}: paused"
    if kind == "resumed":
        return "info", f"step {step}: resumed"
    if kind == "edited":
        changes = " ".join(f"{k}={fmt_number(v) if isinstance(v, float) else v}" for k, v in data.items()
                           if k != "reason")
        why = f" ({data['reason']})" if data.get("reason") else ""  # an agent's decision says why
        return "info", f"step {step}: set {changes}{why}"
    if kind == "started":
        return "info", f"step {step}: started, {data.get('max_steps', '?')} steps"
    if kind == "deleted":
        return "warn", f"deleted {Path(str(data.get('checkpoint', ''))).name}"
    if kind == "resume_from":
        return "info", f"resuming from {Path(str(data.get('checkpoint', ''))).name}"
    if kind == "finished":
        code = f" (exit code {data['exit_code']})" if data.get("exit_code") is not None else ""
        if data.get("stopped"):
            by = f" by {data['stop_reason']}" if data.get("stop_reason") else ""
            return "warn", f"step {step}: stopped{by}{code}"
        return "good", f"step {step}: finished{code}"
    if kind == "failed":
        return "error", f"step {step}: failed: {data.get('error', '')}"
    if kind in ("gone", "followed"):  # an attached run ended without a last word / was restarted
        return ("error" if kind == "gone" else "info"), str(data.get("note", kind))
    if kind == "warning":
        return "warn", f"step {step}: {data.get('message', '')}"
    return "info", f"step {step}: {kind}"


# -- guard interventions ------------------------------------------------------------------------

# One colour per kind of intervention, the same in both front-ends: hex, which Rich markup,
# plotext (as RGB) and bqplot all take, and which no terminal theme remaps.
GUARD_COLORS = {"nonfinite": "#e04040", "spike": "#e8b000"}


def _guard_value(value: Any) -> str:
    return fmt_number(value, 3) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _sample_list(samples: Sequence[int], limit: int) -> str:
    shown = " ".join(str(i) for i in samples[:limit])
    return shown + (f" …+{len(samples) - limit}" if len(samples) > limit else "") if samples else "-"


def intervention_cells(item: Any, sample_limit: int = 6) -> tuple[str, str, str, str, str]:
    """(step, kind, action, value/threshold, samples) of an ``Intervention`` as text.

    A rollback's action says where it went back to and how many rows it jumped over; the
    threshold is shown for spikes only (a non-finite loss has no bar to compare with).
    """
    kind = "nan/inf" if item.kind == "nonfinite" else item.kind
    action = item.action
    if item.action == "rollback" and item.restored_step is not None:
        action = f"rollback→{item.restored_step}"
        if item.skipped_samples:
            action += f" (skip {item.skipped_samples})"
    value = _guard_value(item.value)
    if item.kind == "spike" and item.threshold is not None:
        value += f" > {_guard_value(item.threshold)}"
    return str(item.step), kind, action, value, _sample_list(item.samples, sample_limit)


def describe_intervention(item: Any) -> tuple[str, str]:
    """(level, text) for the event log: one line per intervention."""
    step, kind, action, value, samples = intervention_cells(item)
    return "warn", f"step {step}: guard {kind} {value}: {action}, samples {samples}"


def progress_line(snapshot: Any) -> str:
    """"step 120/300 · epoch 1.60 · 410 samples/s · 52k tokens/s · ETA 5s"."""
    parts = [f"step {snapshot.step}/{snapshot.max_steps or '?'}"]
    if snapshot.epoch is not None:
        parts.append(f"epoch {snapshot.epoch:.2f}")
    parts.append(fmt_rate(snapshot.samples_per_second, "samples"))
    if snapshot.tokens_per_second:
        parts.append(fmt_rate(snapshot.tokens_per_second, "tok"))
    running = snapshot.status in (Status.RUNNING, Status.EVALUATING, Status.SAVING)
    parts.append(f"ETA {fmt_duration(snapshot.eta) if running else '-'}")
    return " · ".join(parts)


def summary_lines(snapshot: Any, with_time: bool = True) -> list[str]:
    """What stays on screen after the run, in this order: the outcome, the error (if any),
    the best (or newest) checkpoint, the final metrics, where the files are."""
    outcome = f"{snapshot.status} at step {snapshot.step}/{snapshot.max_steps}"
    lines = [outcome + (f" after {fmt_duration(snapshot.elapsed)}" if with_time else "")]
    if snapshot.error:
        lines.append(f"error: {snapshot.error}")
    best = next((c for c in snapshot.checkpoints if getattr(c, "best", False)), None)
    if best is not None:
        metrics = _metrics_text(best.metrics, limit=1)
        lines.append(f"best {best.name}" + (f" ({metrics})" if metrics else ""))
    elif snapshot.checkpoints:
        lines.append(f"newest {snapshot.checkpoints[-1].name}")
    finals = [f"{'train_loss' if row.name == 'loss' else _short(row.name)}={fmt_number(row.latest)}"
              for row in metric_rows(snapshot.series, snapshot.best_metric, snapshot.best_step)[:4]]
    if finals:
        lines.append("final " + " ".join(finals))
    if snapshot.output_dir:
        lines.append(f"files in {snapshot.output_dir}")
    return lines

