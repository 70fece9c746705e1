"""Live line charts for the notebook panel, drawn with bqplot.

Each chart is built once: a bqplot ``Figure`` with one ``Lines`` mark per series. A refresh
only assigns new ``x``/``y`` arrays to the marks whose series changed, so the browser
moves the existing SVG paths instead of rebuilding the figure (no clear-and-redraw flicker),
and bqplot ships the arrays as binary buffers rather than JSON lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from bqplot import Axis, Figure, LinearScale, Lines
from ipywidgets import Layout, Widget

__all__ = ["Trace", "LiveChart"]

Point = tuple[int, float]


@dataclass(frozen=True)
class Trace:
    """One line of a chart: which snapshot series it draws, and how.

    ``axis`` is "left" or "right" (two y scales, e.g. learning rate and grad norm, whose
    magnitudes differ by orders); ``marker`` draws the points too, so a single evaluation
    (eval_on_start at step 0) is visible before there is a line to draw.
    """

    series: str
    label: str
    color: str
    axis: str = "left"
    marker: str | None = None
    dashed: bool = False  # a planned curve (the learning rate to come), not a measured one


def _label_offset(tick_format: str | None) -> str:
    # Room for the tick labels between a vertical axis and its label: "2.4e-4" is wider than "4.45".
    return "7ex" if tick_format and "e" in tick_format else "5ex"


def _key(points: Sequence[Point]) -> tuple:
    # Series only grow at the end, are thinned at the front when they get long, and start
    # over after resume_from: length plus first and last point tells every case apart.
    return (len(points), points[0], points[-1]) if points else (0,)


class LiveChart:
    """A bqplot figure whose lines follow named (step, value) series."""

    def __init__(self, title: str, traces: Sequence[Trace], left_label: str, right_label: str | None = None,
                 tick_format: Mapping[str, str] | None = None, width: str = "49%", height: str = "280px") -> None:
        """Build the figure once; ``update`` later only feeds data into it."""
        self.traces = tuple(traces)
        tick_format = dict(tick_format or {})
        # A degenerate domain (one point at step 0, max unknown yet) leaves bqplot's axis
        # without ticks even after it widens, so the x range is never empty.
        self.x_scale = LinearScale(min=0.0, max=1.0, allow_padding=False)
        self.y_scales = {"left": LinearScale()}
        if right_label is not None or any(t.axis == "right" for t in self.traces):
            self.y_scales["right"] = LinearScale()
        self.lines: dict[str, Lines] = {}
        for trace in self.traces:
            self.lines[trace.series] = Lines(
                x=np.zeros(0), y=np.zeros(0),
                scales={"x": self.x_scale, "y": self.y_scales[trace.axis]},
                colors=[trace.color], labels=[trace.label], display_legend=True,
                marker=trace.marker, marker_size=36, stroke_width=2,
                line_style="dashed" if trace.dashed else "solid",
            )
        # Vertical marks span the plot's height on a fixed 0..1 scale of their own: a step
        # with a NaN loss has no y value to place a point at.
        self.mark_scale = LinearScale(min=0.0, max=1.0, allow_padding=False)
        self.marks = Lines(x=np.zeros((0, 2)), y=np.zeros((0, 2)), scales={"x": self.x_scale, "y": self.mark_scale},
                           colors=["#888888"], stroke_width=1.5, line_style="dashed")
        self._mark_key: tuple = ()
        self.axes = [Axis(scale=self.x_scale, side="bottom", label="step", grid_lines="dashed", num_ticks=6)]
        self.axes.append(Axis(scale=self.y_scales["left"], side="left", label=left_label, grid_lines="dashed",
                              tick_format=tick_format.get("left"), label_offset=_label_offset(tick_format.get("left"))))
        if "right" in self.y_scales:
            self.axes.append(Axis(scale=self.y_scales["right"], side="right", label=right_label or "",
                                  grid_lines="none", tick_format=tick_format.get("right"),
                                  label_offset=_label_offset(tick_format.get("right"))))
        self.figure = Figure(
            marks=[*self.lines.values(), self.marks], axes=self.axes, title=title, animation_duration=0,
            legend_location="top-right", fig_margin={"top": 40, "bottom": 40, "left": 72, "right": 64},
            min_aspect_ratio=0.01, max_aspect_ratio=100.0,
            layout=Layout(width=width, min_width="300px", height=height),
        )
        self._keys: dict[str, tuple] = {}
        self._max_steps = 0

    @property
    def widgets(self) -> list[Widget]:
        """Every widget of the chart (for hold_sync and close)."""
        return [self.figure, self.x_scale, *self.y_scales.values(), *self.lines.values(), *self.axes,
                self.mark_scale, self.marks]

    def update(self, series: Mapping[str, Sequence[Point]], max_steps: int = 0) -> int:
        """Feed the newest series in; returns how many lines changed (0 sends nothing).

        The x axis spans 0..max_steps from the start, so new points extend the line to the
        right instead of rescaling everything on every refresh.
        """
        if max_steps and max_steps != self._max_steps:
            self._max_steps = max_steps
            self.x_scale.max = float(max_steps)
        changed = 0
        for trace in self.traces:
            points = series.get(trace.series, ())
            key = _key(points)
            if self._keys.get(trace.series) == key:
                continue
            self._keys[trace.series] = key
            line = self.lines[trace.series]
            if points:
                data = np.asarray(points, dtype=np.float64)
                x, y = data[:, 0], data[:, 1]
            else:
                x, y = np.zeros(0), np.zeros(0)
            # Under the caller's hold_sync both arrays reach the browser in one message,
            # never as an x of one length paired with a y of another.
            line.x = x
            line.y = y
            changed += 1
        return changed

    def set_marks(self, marks: Sequence[tuple[int, str]]) -> bool:
        """Vertical lines at ``(step, colour)`` marks (e.g. guard interventions); returns
        whether they changed (unchanged marks send nothing)."""
        marks = tuple(marks)
        if marks == self._mark_key:
            return False
        self._mark_key = marks
        steps = np.asarray([[float(s), float(s)] for s, _ in marks], dtype=np.float64).reshape(-1, 2)
        self.marks.x = steps
        self.marks.y = np.tile([0.0, 1.0], (len(marks), 1))
        self.marks.colors = [color for _, color in marks] or ["#888888"]
        return True

    def marked(self) -> list[tuple[int, str]]:
        """The (step, colour) of each vertical mark the chart holds (what the browser draws)."""
        x = np.asarray(self.marks.x).reshape(-1, 2)
        return [(int(row[0]), color) for row, color in zip(x, self.marks.colors)]

    def points(self, series: str) -> list[Point]:
        """The (step, value) points the chart currently holds for ``series`` (what the browser draws)."""
        line = self.lines[series]
        return [(int(s), float(v)) for s, v in zip(np.asarray(line.x), np.asarray(line.y), strict=True)]

    def close(self) -> None:
        """Close the figure and its marks, scales and axes (frees their comms)."""
        for widget in self.widgets:
            widget.close()
