"""Formatting shared by the front-ends (terminal dashboard, notebook panel).

Everything here is pure: numbers, durations, byte sizes, series downsampling and the
wording of events and summaries, computed from a ``Snapshot`` or ``SessionEvent``. Keeping
it free of any UI library means both front-ends say the same thing in the same words, and
it can be tested without a terminal or a browser.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.door.endings import describe_end, describe_end_record
from workbench.door.values import ENDED, Status, goodput_line
from workbench.door.values import describe_proposal_event, edit_changes, is_timing_metric

__all__ = [
    "TERMINAL",
    "TRAIN_SERIES",
    "Point",
    "MetricRow",
    "MemoryRow",
    "fmt_number",
    "fmt_lr",
    "edit_text",
    "fmt_plain",
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
    "GRADS_FREED",
    "describe_event",
    "elapsed_text",
    "summary_lines",
    "progress_line",
    "GUARD_COLORS",
    "intervention_cells",
    "describe_intervention",
    "SAMPLE_EVENT",
    "SampleAnswer",
    "SampleBook",
    "answer_text",
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


def fmt_plain(value: Any) -> str:
    """A value as a person types it: 1e-4 (not 0.0001 or 1.00e-04), 0.003, 200, True, text
    as it is; a mapping as "key value, ..." and a list comma-separated (ctl's replies)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return str(value)
        if abs(value) < 1e-2 or abs(value) >= 1e6:
            mantissa, _, exponent = f"{value:.3e}".partition("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_plain(v) for v in value)
    return str(value)


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


# What the gradient figures say between steps, where the loop has freed them.
GRADS_FREED = "freed after each step (zero_grad set_to_none)"


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
    frozen = getattr(report, "frozen_parameters", 0) or 0
    params = ([MemoryRow("trained", report.parameters - frozen, model_total),
               MemoryRow("frozen", frozen, model_total, note="no grads, no optimizer state")]
              if frozen else [MemoryRow("params", report.parameters, model_total)])
    # Between steps the loop frees the gradients (zero_grad(set_to_none=True), as HF does): a
    # reading taken there has none, which is said, not drawn as an empty "0 B" bar.
    freed = report.gradients == 0 and report.parameters - frozen > 0
    rows = [
        *params,
        MemoryRow("grads", None, model_total, note=GRADS_FREED) if freed
        else MemoryRow("grads", report.gradients, model_total),
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


# The arguments of each schedule change, in the order a label shows them (core/schedule_edits.py).
_SCHEDULE_ARGS = {"decay_now": ("steps", "to", "shape"), "extend": ("max_steps",), "rewarm": ("steps", "peak", "shape"),
                  "scale_peak": ("factor",)}


def edit_text(key: str, value: Any) -> str:
    """One edited value as the front-ends show it: a number compactly, a schedule change as
    its operation and arguments (``decay_now steps=200 to=min_lr shape=cosine``)."""
    if key == "schedule" and isinstance(value, dict):
        op = value.get("op")
        args = " ".join(f"{k}={fmt_number(value[k]) if isinstance(value[k], float) else value[k]}"
                        for k in _SCHEDULE_ARGS.get(op, ()) if k in value)
        return f"{op} {args}".strip()
    return fmt_number(value) if isinstance(value, float) else str(value)


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
        changes = " ".join(f"{k}={edit_text(k, v)}" for k, v in edit_changes(data).items())
        if not changes:  # a record that changes nothing itself: a kept fork variant's, say
            return "info", f"step {step}: {data.get('reason') or 'edited'}"
        why = f" ({data['reason']})" if data.get("reason") else ""  # an agent's decision says why
        return "info", f"step {step}: set {changes}{why}"
    if kind in ("proposal", "proposal_decided"):  # a change proposed to the run, and what became of it
        return describe_proposal_event(kind, step, data)
    if kind == "started":
        return "info", f"step {step}: started, {data.get('max_steps', '?')} steps"
    if kind == "deleted":
        return "warn", f"deleted {Path(str(data.get('checkpoint', ''))).name}"
    if kind == "resume_from":
        return "info", f"resuming from {Path(str(data.get('checkpoint', ''))).name}"
    if kind == "finished":  # a live run's last event, or a recorded run's end record (watch)
        text = describe_end_record({**data, "step": step})
        return ("good" if text.startswith("finished") else "warn"), text
    if kind == "failed":
        return "error", f"step {step}: failed: {data.get('error', '')}"
    if kind in ("gone", "followed"):  # an attached run ended without a last word / was restarted
        return ("error" if kind == "gone" else "info"), str(data.get("note", kind))
    if kind == "warning":
        return "warn", f"step {step}: {data.get('message', '')}"
    if kind == SAMPLE_EVENT:
        return None  # the samples panel (dashboard) and tab (notebook) show them, by prompt
    if kind == "hang":
        where = "sends no heartbeat" if data.get("silent") else f"stuck in {data.get('phase')}"
        return "error", (f"hang: rank {data.get('rank')} {where} at step {data.get('stalled_step')} for "
                         f"{fmt_duration(data.get('seconds'))}; stacks in {data.get('folder')}")
    if kind == "hang_cleared":
        now = "its training ended" if data.get("phase_now") == "done" else f"now in {data.get('phase_now')}"
        return "good", (f"hang over: rank {data.get('rank')} moved on from {data.get('phase')} at step "
                        f"{data.get('stalled_step')} after {fmt_duration(data.get('seconds'))} ({now})")
    if kind == "straggler":
        return "warn", (f"step {step}: straggler: rank {data.get('rank')} takes {data.get('factor')}x the other "
                        "ranks' time for its own work")
    if kind == "fork_saved":  # a fork's variant written to a folder of its own (the run stays at its pause)
        return "good", f"step {step}: fork {data.get('id')}: variant {data.get('variant')} saved to {data.get('path')}"
    if kind == "eval_oom":  # evaluation batches cut: the training batch is untouched
        return "warn", f"step {step}: {data.get('reason') or 'out of memory in evaluation'}"
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


def health_line(snapshot: Any) -> str:
    """Where the time goes and how fast, from a snapshot's ``health`` (door/values.py):
    "goodput 93%: data 4%, eval 2% · MFU 41%", or the hang, first, when there is one."""
    health = getattr(snapshot, "health", None) or {}
    hang = health.get("hang")
    parts = []
    if hang:
        where = "silent" if hang.get("silent") else f"in {hang.get('phase')}"
        parts.append(f"HANG: rank {hang.get('rank')} {where} at step {hang.get('stalled_step')} for "
                     f"{fmt_duration(hang.get('seconds'))}; stacks in {hang.get('folder')}")
    if health.get("ledger"):
        parts.append(goodput_line(health["ledger"]))
    rates = health.get("throughput") or {}
    if rates.get("mfu") is not None:
        parts.append(f"MFU {rates['mfu']:.0%}")
    stragglers = (health.get("stragglers") or {}).get("ranks") or []
    if stragglers:
        parts.append("straggler: " + ", ".join(f"rank {s['rank']} {s['factor']}x" for s in stragglers))
    return " · ".join(parts)


def ranks_line(health: dict[str, Any] | None) -> str:
    """Each rank's own work per step (data, forward, optimizer) and its factor over the other
    ranks' median, from a snapshot's ``health["ranks"]``: "" with fewer than two ranks."""
    ranks = (health or {}).get("ranks") or {}
    if len(ranks) < 2:
        return ""

    def one(rank: str, r: dict[str, Any]) -> str:
        work = r.get("work_per_step") or 0.0
        factor = f"{r['factor']:.2f}x" if r.get("factor") is not None else "-"
        ledger = r.get("ledger") or {}
        good = f" goodput {ledger['compute'] / ledger['wall']:.0%}" if ledger.get("wall") else ""
        return f"{rank} {work * 1000:.1f} ms {factor}{good}" if work else f"{rank} -"

    return "work a step by rank (x the others' median): " + " · ".join(
        one(rank, r) for rank, r in sorted(ranks.items(), key=lambda kv: int(kv[0])))


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


def elapsed_text(snapshot: Any) -> str:
    """"elapsed 1:23" of training time, with the time spent paused apart: "elapsed 1:23
    (paused 0:45)" (the elapsed clock stops while paused, so it never jumps back)."""
    paused = getattr(snapshot, "paused", 0.0) or 0.0
    return f"elapsed {fmt_clock(snapshot.elapsed)}" + (f" (paused {fmt_clock(paused)})" if paused >= 1 else "")


def summary_lines(snapshot: Any, with_time: bool = True) -> list[str]:
    """What stays on screen after the run, in this order: the outcome (who stopped it, in
    door/endings.py's words), the error (if any), the best (or newest) checkpoint, the final
    metrics, where the files are."""
    status = getattr(snapshot.status, "value", snapshot.status)
    reason = getattr(snapshot, "stop_reason", None)
    outcome = describe_end(status, reason, f"{snapshot.step}/{snapshot.max_steps}", saved=None)
    paused = getattr(snapshot, "paused", 0.0) or 0.0
    took = f" after {fmt_duration(snapshot.elapsed)}" + (f" (paused {fmt_duration(paused)})" if paused >= 1 else "")
    lines = [outcome + (took if with_time else "")]
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



# -- samples: answers to fixed prompts as the run trains --------------------------------------

SAMPLE_EVENT = "sampled"  # a SessionEvent per prompt and sample point: {prompt, answer, tokens}


@dataclass(frozen=True)
class SampleAnswer:
    """One answer to a prompt: the step whose weights gave it, its text, its new tokens."""

    step: int
    answer: str
    tokens: int | None = None


class SampleBook:
    """The samples a run took (``sampled`` events), gathered by prompt for both front-ends:
    prompts in the order first seen, each one's answers newest first (the order they came,
    reversed: a resumed run may sample an earlier step again). The newest ``per_prompt``
    answers of each prompt are kept."""

    def __init__(self, per_prompt: int = 100) -> None:
        self.per_prompt = per_prompt
        self._answers: dict[str, deque[SampleAnswer]] = {}
        self.count = 0  # answers added in all (a front-end redraws when it changes)

    def add(self, kind: str, step: int, data: dict[str, Any]) -> bool:
        """Keep the answer of a ``sampled`` event; False (nothing kept) for any other event."""
        prompt, answer = data.get("prompt"), data.get("answer")
        if kind != SAMPLE_EVENT or not isinstance(prompt, str) or not isinstance(answer, str):
            return False
        tokens = data.get("tokens")
        kept = self._answers.setdefault(prompt, deque(maxlen=self.per_prompt))
        kept.appendleft(SampleAnswer(step, answer, tokens if isinstance(tokens, int) else None))
        self.count += 1
        return True

    def clear(self) -> None:
        """Forget every answer (the front-end follows another run)."""
        self._answers.clear()
        self.count = 0

    def prompts(self) -> list[tuple[str, list[SampleAnswer]]]:
        """(prompt, answers newest first) for each prompt, in the order first seen."""
        return [(prompt, list(answers)) for prompt, answers in self._answers.items()]

    def __bool__(self) -> bool:
        return bool(self._answers)


def answer_text(text: str, limit: int | None = None) -> str:
    """An answer on one line: line breaks shown as ``↵``, cut to ``limit`` characters with "…";
    an answer of white space only is said to be one, never shown as nothing."""
    shown = text.replace("\r\n", "\n").replace("\n", "↵")
    if not shown.strip():
        return f"(only white space: {len(text)} characters)" if text else "(empty)"
    if limit is not None and len(shown) > limit:
        shown = shown[:max(limit - 1, 0)] + "…"
    return shown
