"""The main screen: header, progress, loss and LR/grad-norm charts, the guard's steps, the
run's samples, metrics, memory, event log.

It owns no state about the run: the app hands it each new ``Snapshot`` (``show``) and each
event (``log_event``), both on the app's loop. Keys here are the run's controls; they call
the app's actions, which talk to the Session.
"""

from __future__ import annotations

import time
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer

from workbench.widgets.view import GUARD_COLORS, TERMINAL, SampleBook, describe_event, describe_intervention

from .charts import LossChart, RateChart
from .panels import (
    EventPanel,
    GuardTable,
    MemoryPanel,
    MetricsTable,
    Parts,
    ProgressPanel,
    RunHeader,
    SamplesPanel,
    SummaryPanel,
)

__all__ = ["DashboardScreen"]

# Charts and the metrics table cost a few ms to draw (CPU the training thread could use);
# every two seconds is enough for curves that move by a few pixels. Where a draw costs more
# (a loaded machine, a wide terminal, noisy curves: plotext draws each segment point by
# point) the draws are spaced so that the charts use at most CHART_BUDGET of a core, up to
# CHART_INTERVAL_MAX apart. An attached dashboard (a process of its own, often one of
# several watching a run) is held to CHART_BUDGET_ATTACHED: its whole process should use
# under 5% of a core, and the charts were the largest part of that.
CHART_INTERVAL = 2.0
CHART_BUDGET = 0.025
CHART_BUDGET_ATTACHED = 0.01
CHART_INTERVAL_MAX = 10.0


class DashboardScreen(Parts, Screen):
    """Everything about the run on one screen, readable at 80x24."""

    BINDINGS = [
        Binding("space,p", "app.toggle_pause", "pause"),
        Binding("s", "app.save", "save"),
        Binding("e", "app.evaluate", "eval"),
        Binding("c", "app.checkpoints", "ckpts"),
        Binding("i", "app.inspect", "inspect"),
        Binding("l", "app.edit", "edit"),
        Binding("f", "app.fork", "fork"),
        Binding("y", "toggle_log", "log-y"),
        Binding("m", "toggle_smooth", "smooth"),
        Binding("a", "toggle_samples", "samples"),  # in the footer once the run has samples (check_action)
        Binding("o", "app.autopilot", "autopilot"),  # with an autopilot only (the app's check_action)
        Binding("q", "app.request_quit", "quit"),
        Binding("question_mark", "app.help", "help", key_display="?"),
    ]

    def __init__(self, chart_budget: float = CHART_BUDGET) -> None:
        super().__init__(id="dashboard")
        self.chart_budget = chart_budget  # the share of a core chart redraws may use
        self.log_scale = False
        self.smoothing = False
        self._chart_at = 0.0
        self._series: dict | None = None  # what the charts show
        self._pending: dict | None = None  # newer series waiting for the throttle
        self._chart_timer: Any = None
        self._snapshot: Any = None
        self._plan: tuple = ()  # the planned learning rate last drawn (snapshot.lr_plan)
        self._backlog: list[tuple[str, str]] = []
        self._best: tuple[float | None, int | None] = (None, None)
        self._interventions: tuple = ()  # the guard's, as the charts and the table show them
        self._intervention_total = 0  # how many the guard made in all (the snapshot lists the newest)
        self.samples = SampleBook()  # the run's answers to its prompts, from its sampled events
        self.samples_hidden = False  # the user hid the samples panel (a)
        self._samples_key = False  # whether the footer offers the a key (the run has samples)

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield ProgressPanel(id="progress")
        yield SummaryPanel(id="summary")
        with Horizontal(id="charts"):
            yield LossChart(id="loss-chart")
            yield RateChart(id="rate-chart")
        yield GuardTable(id="guard")
        yield SamplesPanel(id="samples")
        with Horizontal(id="panels"):
            yield MetricsTable(id="metrics")
            yield MemoryPanel(id="memory")
            yield EventPanel(id="events", max_lines=1000, wrap=True, markup=False, min_width=10)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#loss-chart").border_title = "loss [cyan]train[/] [orange1]● eval[/]"
        self.query_one("#rate-chart").border_title = "[green]lr[/] · [magenta]grad norm[/]"
        self.query_one("#metrics").border_title = "metrics"
        self.query_one("#memory").border_title = "memory"
        self.query_one("#events").border_title = "events"
        self.query_one("#summary").display = False
        nan, spike = GUARD_COLORS["nonfinite"], GUARD_COLORS["spike"]
        self.query_one("#guard").border_title = f"guard: [{nan}]nan/inf[/] [{spike}]spike[/]"
        self.query_one("#guard").display = False  # until the guard acts
        self.query_one("#samples").border_title = "samples [dim](a hides)[/]"
        self._show_samples()  # hidden until the run has samples (events may have come first)
        if self._backlog:
            level, text = self._backlog.pop()
            self.log_line(level, text)

    # -- updates from the app ---------------------------------------------------------------

    def show(self, snapshot: Any, frozen: bool = False) -> bool:
        """Show a new snapshot (charts at most every chart_interval() seconds); False when a
        panel has not composed its parts yet, so the caller shows it again next time (an
        ended run's snapshot never changes: it would otherwise stay half shown)."""
        try:
            self._show(snapshot, frozen)
        except NoMatches:
            return False
        return True

    def _show(self, snapshot: Any, frozen: bool) -> None:
        self._snapshot = snapshot
        self.part(RunHeader).show(snapshot, frozen)
        done = snapshot.status in TERMINAL
        progress = self.part(ProgressPanel)
        summary = self.part(SummaryPanel)
        if summary.display != done:  # a display change is a layout pass: only on the switch
            progress.display = not done
            summary.display = done
        if done:
            summary.show(snapshot, frozen)
        else:
            progress.show(snapshot, frozen)
        self._best = (snapshot.best_metric, snapshot.best_step)
        self.part(MemoryPanel).show(snapshot.memory, frozen, ended=done)
        interventions = getattr(snapshot, "interventions", ())
        if interventions != self._interventions:
            self._show_interventions(interventions, snapshot.guard_interventions)
        if snapshot.series is not self._series and snapshot.series is not self._pending:
            self._pending = snapshot.series
            wait = self.chart_interval() - (time.monotonic() - self._chart_at)
            if wait <= 0 or done:
                self._flush_charts()
            elif self._chart_timer is None:
                # Throttled: draw when the interval is over, even if no newer snapshot comes
                # (a paused run publishes one snapshot after an evaluation, then none).
                self._chart_timer = self.set_timer(wait, self._flush_charts)
        elif getattr(snapshot, "lr_plan", ()) != self._plan and self._series is not None:
            self._draw_charts()  # a schedule edit while paused: the series stay, the plan moves

    def _show_interventions(self, interventions: tuple, total: int) -> None:
        """List the guard's interventions, log the new ones and mark them on the loss chart
        (at once: a few a run, each worth seeing before the next chart interval). The
        snapshot lists the newest only; ``total`` counts all, so the new ones are known."""
        new = max(0, total - self._intervention_total) if total else len(interventions) - len(self._interventions)
        for item in interventions[max(0, len(interventions) - new):]:
            self.log_line(*describe_intervention(item))
        self._interventions, self._intervention_total = interventions, total
        table = self.part(GuardTable)
        table.show(interventions)
        if table.display != bool(interventions):
            table.display = bool(interventions)
        chart = self.part(LossChart)
        chart.border_title = ("loss [cyan]train[/] [orange1]● eval[/]"
                              + (f" [{GUARD_COLORS['nonfinite']}]│[/][{GUARD_COLORS['spike']}]│[/] guard"
                                 if interventions else ""))
        if self._series is not None:
            self._draw_charts()

    def chart_interval(self) -> float:
        """Seconds between chart redraws: CHART_INTERVAL, or longer when the last draws were
        costly (their CPU time over ``chart_budget``, at most CHART_INTERVAL_MAX)."""
        cost = self.part(LossChart).build_seconds + self.part(RateChart).build_seconds
        return min(max(CHART_INTERVAL, cost / self.chart_budget), CHART_INTERVAL_MAX)

    def _flush_charts(self) -> None:
        self._chart_timer = None
        if self._pending is None:
            return
        self._series, self._pending = self._pending, None
        self._chart_at = time.monotonic()
        self._draw_charts()

    def reset(self) -> None:
        """Forget the drawn series and the samples (a resumed or branched run starts new ones;
        the app reads the run's events again from its first)."""
        self._series = self._pending = None
        self._chart_at = 0.0
        self.samples.clear()
        self._show_samples()

    def _draw_charts(self) -> None:
        # The metrics table follows the same series, so it keeps the charts' pace.
        series = self._series or {}
        self.part(LossChart).show(series, log_scale=self.log_scale, smoothing=self.smoothing,
                                       interventions=self._interventions)
        self._plan = getattr(self._snapshot, "lr_plan", ())
        self.part(RateChart).show(series, plan=self._plan)
        self.part(MetricsTable).show(series, *self._best)

    def log_event(self, kind: str, step: int, data: dict[str, Any]) -> None:
        """Add a session event to the log (ordinary loss logs are left to the chart; samples
        go to the samples panel)."""
        if self.samples.add(kind, step, data):
            self._show_samples()
            return
        described = describe_event(kind, step, data)
        if described is not None:
            self.log_line(*described)

    def log_line(self, level: str, text: str) -> None:
        """Add one line to the event log (kept until the log exists: events can come first)."""
        logs = self.query(EventPanel)
        if not logs:
            self._backlog.append((level, text))
            return
        log = logs.first()
        backlog, self._backlog = self._backlog, []
        for early in backlog:  # in order: the backlog came first
            log.add(*early)
        log.add(level, text)

    def on_resize(self) -> None:
        # The charts pick their point count and ticks from their size.
        if self._series is not None:
            self.call_after_refresh(self._draw_charts)

    def _show_samples(self) -> None:
        """Show the samples panel with every answer, once the run has some and unless hidden."""
        panels = self.query(SamplesPanel)
        if not panels:
            return  # not composed yet: on_mount shows what came
        panel = panels.first()
        shown = bool(self.samples) and not self.samples_hidden
        if shown:
            panel.show(self.samples)
        if panel.display != shown:  # a display change is a layout pass: only on the switch
            panel.display = shown
        if bool(self.samples) != self._samples_key:
            self._samples_key = bool(self.samples)
            self.refresh_bindings()  # the a key appears in the footer with the first samples

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The samples toggle exists (and shows in the footer) only once the run has samples."""
        if action == "toggle_samples":
            return bool(self.samples)
        return True

    def action_toggle_samples(self) -> None:
        """Hide the samples panel, or show it again."""
        self.samples_hidden = not self.samples_hidden
        self._show_samples()
        self.notify(f"samples {'hidden' if self.samples_hidden else 'shown'}", timeout=2)

    # -- chart toggles --------------------------------------------------------------------------

    def action_toggle_log(self) -> None:
        """Switch the loss chart between a linear and a log y axis."""
        self.log_scale = not self.log_scale
        self._draw_charts()
        self.notify(f"loss axis: {'log' if self.log_scale else 'linear'}", timeout=2)

    def action_toggle_smooth(self) -> None:
        """Show the train loss raw, or smoothed over the raw curve."""
        self.smoothing = not self.smoothing
        self._draw_charts()
        self.notify(f"smoothing {'on' if self.smoothing else 'off'}", timeout=2)
