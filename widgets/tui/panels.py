"""The panels of the main screen. Each shows one part of a ``Snapshot`` and is updated by
the dashboard on the app's loop (never from another thread)."""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import RichLog, Static

from workbench.door.values import Status
from workbench.widgets.view import (
    health_line,
    MemoryRow,
    MetricRow,
    fmt_bytes,
    GUARD_COLORS,
    SampleBook,
    answer_text,
    fmt_number,
    intervention_cells,
    memory_rows,
    metric_rows,
    progress_line,
    status_label,
    summary_lines,
    elapsed_text,
)

__all__ = ["Parts", "RunHeader", "ProgressPanel", "MetricsTable", "MemoryPanel", "EventPanel", "SummaryPanel", "GuardTable",
           "SamplesPanel"]

STATUSES = tuple(Status)  # one CSS class per status: .status-idle, .status-running, ...


def set_text(widget: Static, content: str | Text) -> None:
    """Update a fixed-size Static only when its text changed, without a layout pass.

    At ~8 updates a second, re-laying out the screen for every label was most of the
    dashboard's CPU use; these labels never change size, so a repaint is enough.
    """
    if widget.content != content:
        widget.update(content, layout=False)


class Parts:
    """``part(selector)``: ``query_one(selector)``, remembered. A query walks the widget tree
    matching CSS each time (a dozen a poll, several polls a second, was a third of the
    dashboard's poll); these panels never replace the parts they compose."""

    _parts: dict[Any, Widget] | None = None

    def part(self, selector: Any) -> Any:
        """The one descendant matching ``selector`` (a type or a CSS selector); NoMatches
        before it is composed (then asked again next time)."""
        if self._parts is None:
            self._parts = {}
        found = self._parts.get(selector)
        if found is None:
            found = self._parts[selector] = self.query_one(selector)  # type: ignore[attr-defined]
        return found


class RunHeader(Parts, Horizontal):
    """One line: run name, status badge, device, elapsed time."""

    def compose(self) -> ComposeResult:
        yield Static("workbench", id="run-name")
        yield Static(" IDLE ", id="badge", classes="status-idle")
        yield Static("", id="device")
        yield Static("", id="elapsed")

    def show(self, snapshot: Any, frozen_clock: bool = False) -> None:
        """Show ``snapshot``; ``frozen_clock`` hides the ticking elapsed time (snapshot tests)."""
        name = self.part("#run-name")
        if str(name.content) != (snapshot.run_name or "workbench"):
            name.update(Text(snapshot.run_name or "workbench", style="bold"))  # width: auto, so a layout pass
        badge = self.part("#badge")
        label = f" {status_label(snapshot.status)} "
        if badge.content != label:
            badge.update(label, layout=False)
            for status in STATUSES:
                badge.set_class(status == snapshot.status, f"status-{status}")
        set_text(self.part("#device"), snapshot.device or "")
        set_text(self.part("#elapsed"), "elapsed -:--:--" if frozen_clock else elapsed_text(snapshot))


class StepBar(Widget):
    """A one-line bar of step / max_steps with the percentage.

    Textual's ProgressBar is four widgets with its own ETA clock; this is one render of
    one line, which matters when it is redrawn several times a second next to training.
    """

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.done = 0
        self.total = 0

    def _drawn(self, done: int, total: int) -> tuple[int, int]:
        fraction = min(done / total, 1.0) if total else 0.0
        return int(fraction * max(self.size.width - 6, 1)), round(fraction * 100)

    def set(self, done: int, total: int) -> None:
        """Show ``done`` of ``total`` steps (redraws only when the drawn bar would change)."""
        if self._drawn(done, total) != self._drawn(self.done, self.total):
            self.refresh()
        self.done, self.total = done, total

    def render(self) -> Text:
        width = max(self.size.width - 6, 1)
        fraction = min(self.done / self.total, 1.0) if self.total else 0.0
        filled = int(fraction * width)
        bar = Text(no_wrap=True)
        bar.append("━" * filled, style="bold dodger_blue2")
        bar.append("━" * (width - filled), style="grey23")
        bar.append(f" {fraction * 100:4.0f}%")
        return bar


class ProgressPanel(Parts, Vertical):
    """A progress bar over max_steps, then step, epoch, throughput and ETA."""

    def compose(self) -> ComposeResult:
        yield StepBar(id="progress-bar")
        yield Static("", id="progress-line")

    def show(self, snapshot: Any, frozen_clock: bool = False) -> None:
        """Show ``snapshot``'s progress; ``frozen_clock`` hides speeds and the ETA (snapshot tests)."""
        self.part(StepBar).set(snapshot.step, snapshot.max_steps)
        line = progress_line(snapshot)
        if frozen_clock:
            line = f"step {snapshot.step}/{snapshot.max_steps or '?'}" + (
                f" · epoch {snapshot.epoch:.2f}" if snapshot.epoch is not None else "")
        health = "" if frozen_clock else health_line(snapshot)
        if health.startswith("HANG"):
            set_text(self.part("#progress-line"), Text(health, style="bold red"))
            return
        set_text(self.part("#progress-line"), f"{line} · {health}" if health else line)


class MetricsTable(Widget):
    """Latest and best value of every evaluation metric (and the train loss); ★ marks the
    metric that picks the best checkpoint, bold marks a latest value that is the best so far."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.rows: list[MetricRow] = []

    def show(self, series: dict, best_metric: float | None, best_step: int | None) -> None:
        """Redraw when the values changed."""
        rows = metric_rows(series, best_metric, best_step)
        if rows != self.rows:
            self.rows = rows
            self.refresh()

    def render(self) -> Text:
        # Plain fixed-width columns: a rich Table costs several ms per draw.
        if not self.rows:
            return Text("no evaluation yet", style="dim")
        width = self.size.width
        wide = width >= 36
        digits = 4 if width >= 30 else 3  # at 80 columns the names need the room
        cells = []
        for row in self.rows:
            name = "train loss" if row.name == "loss" else row.name if row.name == "eval_loss" \
                else row.name.removeprefix("eval_")
            step = "-" if row.best_step is None else str(row.best_step)
            cells.append((name, fmt_number(row.latest, digits), fmt_number(row.best, digits), step, row))
        last_w = max(4, *(len(c[1]) for c in cells))
        best_w = max(4, *(len(c[2]) for c in cells)) + 1  # + the ★ column
        step_w = max(5, *(len(c[3]) for c in cells)) if wide else 0
        name_w = max(width - last_w - best_w - (step_w + 1 if wide else 0) - 3, 4)
        out = Text(no_wrap=True, overflow="ellipsis")
        header = f"{'metric':<{name_w}} {'last':>{last_w}} {'best':>{best_w - 1}} "
        out.append(header + (f"{'@step':>{step_w}}" if wide else ""), style="bold")
        for name, latest, best, step, row in cells:
            shown = name if len(name) <= name_w else name[: name_w - 1] + "…"
            out.append(f"\n{shown:<{name_w}} ")
            is_best = row.latest is not None and row.latest == row.best
            out.append(f"{latest:>{last_w}}", style="bold" if is_best else "")
            out.append(f" {best:>{best_w - 1}}")
            out.append("★" if row.selects_best else " ", style="bold yellow")
            if wide:
                out.append(f" {step:>{step_w}}")
        return out


class GuardTable(Widget):
    """The guard's interventions, newest first: step, kind, action, value (> threshold) and
    the dataset rows of the step. Shown by the dashboard only once there is one."""

    HEADER = ("step", "kind", "action", "loss", "samples")

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.items: tuple = ()

    def show(self, interventions: tuple) -> None:
        """Redraw when the list changed."""
        if interventions != self.items:
            grew = len(interventions) != len(self.items)
            self.items = interventions
            self.refresh(layout=grew)  # height: auto follows the row count

    def render(self) -> Text:
        # Newest first: the table is a few rows high and the latest is what needs a look.
        rows = [(intervention_cells(i), i.kind) for i in reversed(self.items)]
        cells = [self.HEADER] + [c for c, _ in rows]
        widths = [max(len(row[k]) for row in cells) for k in range(4)]
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append("  ".join(f"{h:<{w}}" for h, w in zip(self.HEADER, widths)) + "  samples", style="bold")
        for row, kind in rows:
            out.append("\n")
            out.append(f"{row[0]:<{widths[0]}}  ")
            out.append(f"{row[1]:<{widths[1]}}", style=f"bold {GUARD_COLORS.get(kind, '#aaaaaa')}")
            out.append("  " + "  ".join(f"{c:<{w}}" for c, w in zip(row[2:4], widths[2:4])) + f"  {row[4]}")
        return out


class SamplesPanel(VerticalScroll):
    """The run's samples: each prompt, then its answers newest first with the step whose
    weights gave them. Shown by the dashboard once the run has samples (``a`` hides it)."""

    ANSWER_LIMIT = 600  # characters of one answer shown (max_new_tokens may allow thousands)
    # Scrolled with the mouse wheel; never focused, so the event log keeps the focus it gets first.
    can_focus = False

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.book: SampleBook | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="samples-text")

    def on_mount(self) -> None:
        if self.book is not None:  # samples came before the text was composed (a recorded run's, all at once)
            self.show(self.book)

    def show(self, book: SampleBook) -> None:
        """Redraw from ``book`` (samples come a few at each evaluation: no throttle needed)."""
        self.book = book
        try:
            target = self.query_one("#samples-text", Static)
        except NoMatches:
            return  # on_mount draws it
        prompts = book.prompts()
        width = max((len(str(a.step)) for _, answers in prompts for a in answers), default=1)
        text = Text()
        for i, (prompt, answers) in enumerate(prompts):
            if i:
                text.append("\n")
            text.append(f"▸ {answer_text(prompt, 200)}", style="bold")
            for answer in answers:
                text.append(f"\n  {answer.step:>{width}}  ", style="dim")
                text.append(answer_text(answer.answer, self.ANSWER_LIMIT))
        target.update(text)


class MemoryPanel(Widget):
    """Memory bars with numbers: model tensors against their sum, device/host against their peak."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self._rows: list[MemoryRow] = []
        self._ended = False

    def show(self, report: Any, frozen: bool = False, ended: bool = False) -> None:
        """Show ``report`` (a MemoryUsage); ``frozen`` hides process-dependent host figures (tests).
        ``ended``: the run is over, so a missing reading will not come (a run watched from its
        files has none): said so instead of waiting."""
        rows = memory_rows(report)
        if frozen:
            rows = [r for r in rows if r.label != "host"]
        if rows != self._rows or ended != self._ended:
            self._rows, self._ended = rows, ended
            self.refresh()

    def render(self) -> Text:
        if not self._rows:
            return Text("no reading (the run has ended)" if self._ended else "waiting for the first reading…",
                        style="dim")
        width = self.size.width
        out = Text(no_wrap=True, overflow="ellipsis")
        for i, row in enumerate(self._rows):
            if i:
                out.append("\n")
            out.append(f"{row.label:<7}", style="bold")
            if row.value is None:
                out.append(row.note, style="dim")
                continue
            number = fmt_bytes(row.value)
            if row.peak is not None and width >= 34:
                number = f"{number}/{fmt_bytes(row.peak)}"
            elif row.note and width >= 30:
                number = f"{number} {row.note}"
            bar_width = max(width - 7 - len(number) - 1, 0)
            filled = 0
            if row.scale:
                filled = round(bar_width * min(row.value / row.scale, 1.0))
            out.append("█" * filled, style="cyan")
            out.append("░" * (bar_width - filled), style="grey35")
            out.append(" " + number)
        return out


class EventPanel(RichLog):
    """Evaluations, saves, pauses, edits, warnings and errors, newest at the bottom."""

    STYLES = {"info": "", "good": "green", "warn": "yellow", "error": "bold red"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The entries as written (the widget keeps only wrapped strips): for copying and tests.
        self.history: deque[str] = deque(maxlen=self.max_lines or 1000)

    def add(self, level: str, text: str) -> None:
        """Append one line coloured by ``level``."""
        self.history.append(text)
        self.write(Text(text, style=self.STYLES.get(level, "")))


class SummaryPanel(Static):
    """The run's outcome, kept on screen after it ends: best checkpoint, final metrics, files."""

    def show(self, snapshot: Any, frozen_clock: bool = False) -> None:
        """Show the summary of a finished, stopped or failed ``snapshot`` in three lines
        (four with an error), so the charts keep their room at 80x24."""
        lines = summary_lines(snapshot, with_time=not frozen_clock)
        head = [lines[0]] + [line for line in lines[1:] if line.startswith(("best ", "newest "))]
        rest = [line for line in lines[1:] if not line.startswith(("best ", "newest "))]
        text = Text(" · ".join(head), style="bold")
        for line in rest:
            text.append("\n" + line, style="red" if line.startswith("error:") else "")
        text.append("  (q quits, c checkpoints)", style="dim")
        self.update(text)
