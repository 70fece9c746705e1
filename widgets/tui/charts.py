"""The two charts of the main screen, drawn with plotext (through textual-plotext).

Drawing a plotext figure costs a few milliseconds of CPU, taken from the same GIL the
training thread needs, so a chart redraws only when its data or options changed, and the
dashboard calls ``show`` at a throttled rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from textual_plotext import PlotextPlot

from workbench.widgets.view import GUARD_COLORS, Point, downsample, fmt_number, smooth

__all__ = ["Chart", "LossChart", "RateChart", "PlanChart", "step_ticks", "dashed"]


def step_ticks(lo: int, hi: int, count: int = 5) -> list[int]:
    """Whole-number step ticks on "nice" multiples (1, 2, 5 x 10^k), so the axis reads 0 100 200."""
    span = max(hi - lo, 1)
    raw = span / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next((m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw), 10 * magnitude)
    step = max(int(step), 1)
    first = (lo // step) * step
    return [t for t in range(first, hi + step, step) if lo <= t <= hi] or [lo]


def _sci(value: float) -> str:
    """A compact axis label for a learning rate: 2.8e-3 (rates span decades)."""
    return f"{value:.1e}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def _rgb(color: str) -> tuple[int, int, int]:
    """A "#rrggbb" colour as plotext's RGB tuple (its colour names follow the terminal theme)."""
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def dashed(points: Sequence[Point], width: int) -> list[Point]:
    """``points`` thinned to ``width`` and cut into dashes (two points on, two off): plotext
    draws no dashed lines, and a planned curve must not read as a measured one."""
    thinned = [p for p in downsample(points, width) if math.isfinite(p[1])]
    return [p for i, p in enumerate(thinned) if (i // 2) % 2 == 0]


def _log_points(points: Sequence[Point]) -> list[Point]:
    return [(s, math.log10(v)) for s, v in points if v > 0 and math.isfinite(v)]


class Chart(PlotextPlot):
    """A plot that remembers what it drew (``plotted``) and skips identical redraws."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self._key: tuple | None = None
        self._version = 0  # bumped by every redraw request
        self._rendered: tuple[tuple, Any] | None = None
        self.plotted: dict[str, list[Point]] = {}
        self._builds = 0
        # CPU of the last figure build and of turning it into screen lines (plotext's ANSI
        # text read back and cut into strips: a quarter of the cost): the dashboard spaces
        # redraws by it.
        self.build_seconds = 0.0

    def render(self) -> Any:
        # Textual may ask for the content again (a neighbour repainting, a screen switch);
        # plotext would rebuild the whole figure each time, so reuse the last build.
        key = (self._version, self.size, self.app.theme)
        if self._rendered is None or self._rendered[0] != key:
            began = time.thread_time()
            self._rendered = (key, super().render())
            self._builds += 1
            self.build_seconds = time.thread_time() - began
        return self._rendered[1]

    def render_lines(self, crop: Any) -> Any:
        began, builds = time.thread_time(), self._builds
        lines = super().render_lines(crop)
        if self._builds != builds:  # this call built the figure: count the lines made from it too
            self.build_seconds = time.thread_time() - began
        return lines

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        self._version += 1
        return super().refresh(*args, **kwargs)

    def _redraw(self, *drawn: object) -> bool:
        """Whether the chart must be drawn again for ``drawn`` (what it shows) at its size;
        if so, remembers it and clears the canvas. Polls redraw nothing when nothing changed."""
        key = (*drawn, self.size)
        if key == self._key:
            return False
        self._key = key
        self._begin()
        return True

    def _begin(self) -> None:
        plt = self.plt
        plt.clear_figure()
        plt.xfrequency(0)  # ticks are set explicitly (whole steps)
        plt.frame(False)

    def _x_axis(self, points: list[Point]) -> None:
        if not points:
            return
        lo = min(p[0] for p in points)
        hi = max(p[0] for p in points)
        ticks = step_ticks(lo, hi, 4 if self.size.width < 50 else 6)
        self.plt.xticks(ticks, [str(t) for t in ticks])

    def _max_points(self) -> int:
        # Braille cells hold two points across: more points than that are invisible.
        return max(2 * self.size.width, 40)


class LossChart(Chart):
    """Train loss (optionally smoothed) and eval loss on one step axis, linear or log y."""

    def show(self, series: dict[str, Sequence[Point]], *, log_scale: bool = False, smoothing: bool = False,
             interventions: Sequence[Any] = ()) -> None:
        """Draw ``series["loss"]`` and ``series["eval_loss"]`` (the eval_on_start point at step 0
        included), and a vertical line at each guard intervention's step, coloured by kind."""
        train = series.get("loss", ())
        evals = series.get("eval_loss", ())
        marks = tuple((i.step, i.kind) for i in interventions)
        if not self._redraw(train, evals, log_scale, smoothing, marks):
            return
        plt = self.plt
        width = self._max_points()
        raw = downsample(train, width)
        shown = {"loss": raw, "eval_loss": list(evals)}
        if smoothing and raw:
            shown["loss (smoothed)"] = downsample(smooth(train), width)
        transform = _log_points if log_scale else (lambda pts: [p for p in pts if math.isfinite(p[1])])
        drawn: list[Point] = []
        if smoothing and raw:
            faint = transform(raw)
            if faint:
                plt.plot([p[0] for p in faint], [p[1] for p in faint], marker="braille", color="gray")
            pts = transform(shown["loss (smoothed)"])
            if pts:
                plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="braille", color="cyan")
            drawn += faint + pts
        elif raw:
            pts = transform(raw)
            if pts:
                plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="braille", color="cyan")
            drawn += pts
        eval_pts = transform(shown["eval_loss"])
        if eval_pts:
            plt.scatter([p[0] for p in eval_pts], [p[1] for p in eval_pts], marker="●", color="orange")
            drawn += eval_pts
        for step, kind in marks:
            # A vertical line needs no y value: a NaN step has no loss to place a point at.
            plt.vline(step, color=_rgb(GUARD_COLORS.get(kind, "#aaaaaa")))
        shown["interventions"] = [(step, math.nan) for step, _ in marks]
        self.plotted = shown
        self._x_axis(drawn + shown["interventions"])
        if log_scale and drawn:
            lo, hi = min(p[1] for p in drawn), max(p[1] for p in drawn)
            ticks = [lo + (hi - lo) * i / 3 for i in range(4)] if hi > lo else [lo]
            plt.yticks(ticks, [fmt_number(10**t, 3) for t in ticks])
        self.refresh()


class RateChart(Chart):
    """Learning rate (left axis) and gradient norm (right axis) against steps."""

    def show(self, series: dict[str, Sequence[Point]], plan: Sequence[Point] = ()) -> None:
        """Draw ``series["learning_rate"]`` and ``series["grad_norm"]``, and ``plan`` (the
        learning rate planned for the rest of the run) dashed after the logged rate."""
        lr = series.get("learning_rate", ())
        grad = series.get("grad_norm", ())
        plan = tuple(plan)
        if not self._redraw(lr, grad, plan):
            return
        plt = self.plt
        width = self._max_points()
        lr_pts = [p for p in downsample(lr, width) if math.isfinite(p[1])]
        grad_pts = [p for p in downsample(grad, width) if math.isfinite(p[1])]
        plan_pts = dashed(plan, width)
        if plan_pts:
            plt.scatter([p[0] for p in plan_pts], [p[1] for p in plan_pts], marker="braille", color="green",
                        yside="left")
        rates = lr_pts + plan_pts
        if lr_pts:
            plt.plot([p[0] for p in lr_pts], [p[1] for p in lr_pts], marker="braille", color="green",
                     yside="left")
        if rates:
            lo, hi = min(p[1] for p in rates), max(p[1] for p in rates)
            ticks = [lo + (hi - lo) * i / 2 for i in range(3)] if hi > lo else [lo]
            plt.yticks(ticks, [_sci(t) for t in ticks], yside="left")
        if grad_pts:
            plt.plot([p[0] for p in grad_pts], [p[1] for p in grad_pts], marker="braille", color="magenta",
                     yside="right")
            # Explicit labels with a trailing space: plotext (5.3) drops the last character
            # of right-axis labels in some layouts.
            lo, hi = min(p[1] for p in grad_pts), max(p[1] for p in grad_pts)
            ticks = [lo + (hi - lo) * i / 2 for i in range(3)] if hi > lo else [lo]
            plt.yticks(ticks, [f"{fmt_number(t, 2)} " for t in ticks], yside="right")
        self.plotted = {"learning_rate": lr_pts, "grad_norm": grad_pts, "lr_plan": plan_pts}
        self._x_axis(rates + grad_pts)
        self.refresh()


class PlanChart(Chart):
    """The planned learning rate as it is (green) and as a change would make it (yellow),
    both dashed: the edit form's preview, drawn before anything is applied."""

    def show(self, now: Sequence[Point], proposed: Sequence[Point] = ()) -> None:
        """Draw the current plan and, if given, the proposed one."""
        if not self._redraw(tuple(now), tuple(proposed)):
            return
        plt = self.plt
        width = self._max_points()
        drawn: list[Point] = []
        for points, color in ((now, "green"), (proposed, "yellow")):
            pts = dashed(points, width)
            if pts:
                plt.scatter([p[0] for p in pts], [p[1] for p in pts], marker="braille", color=color)
                drawn += pts
        if drawn:
            lo, hi = min(p[1] for p in drawn), max(p[1] for p in drawn)
            ticks = [lo + (hi - lo) * i / 2 for i in range(3)] if hi > lo else [lo]
            plt.yticks(ticks, [_sci(t) for t in ticks])
        self.plotted = {"now": dashed(now, width), "proposed": dashed(proposed, width)}
        self._x_axis(drawn)
        self.refresh()
