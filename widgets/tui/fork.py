"""The dashboard's fork screen (``f``, issue 28): A/B variants from the paused run.

Type the variants, one a line (``b: learning_rate=1e-3``; ``a:`` alone is the run unchanged)
and the steps, press ctrl+f (or the Fork button): the memory the copies hold is checked and
said first, then each variant trains from the pause on the same batches and is evaluated,
one after another. The table has the final numbers (the parent at the pause first) and the
chart each variant's train loss drawn from the pause over the parent's, and each variant's
evaluation as a dot over the parent's evaluations. Then ``k`` keeps the
selected variant (the run continues from its state, recorded as a live edit), ``s`` saves it
as a checkpoint in a folder of its own (``OUTPUT_DIR-forkN-NAME``; the fork stays open) and
``d`` discards the fork (the run continues from the pause, unchanged). The screen only calls
the session's ``fork_cost``, ``fork``, ``keep``, ``save_variant`` and ``discard`` and shows
``Snapshot.fork``, so
a fork made by a script, the panel or a remote client shows here too.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Static, TextArea

from workbench.door.values import Status
from workbench.widgets.fork_view import (FORK_HINT, fork_eval_series, fork_metrics, fork_rows, fork_series,
                                         fork_summary, parse_variants)

from .charts import Chart

__all__ = ["ForkChart", "ForkScreen"]

_COLORS = ("red", "cyan", "yellow", "magenta", "green", "white")


class ForkChart(Chart):
    """The parent's train loss up to the pause (blue) and each variant's from it; the parent's
    evaluations (orange dots, the last one the fork's own at the pause) and each variant's
    evaluation after its steps (a dot in the variant's colour)."""

    def show(self, series: dict[str, list[tuple[int, float]]],
             evals: dict[str, list[tuple[int, float]]] | None = None) -> None:
        """Draw ``series`` (fork_view.fork_series: "parent" first, then one curve a variant)
        and ``evals`` (fork_view.fork_eval_series, the same names), kept in ``plotted`` as
        ``"eval NAME"``."""
        evals = evals or {}
        if not self._redraw(tuple((k, tuple(v)) for k, v in series.items()),
                            tuple((k, tuple(v)) for k, v in evals.items())):
            return
        plt, drawn = self.plt, []
        colors = {}
        for i, (name, points) in enumerate(series.items()):
            colors[name] = "blue" if name == "parent" else _COLORS[(i - 1) % len(_COLORS)]
            if points:
                plt.plot([p[0] for p in points], [p[1] for p in points], marker="braille", color=colors[name],
                         label=name)
                drawn += points
        for name, points in evals.items():
            if points:  # dots, as the main screen draws evaluations: they are few and far apart
                color = "orange" if name == "parent" else colors.get(name, "white")
                plt.scatter([p[0] for p in points], [p[1] for p in points], marker="●", color=color)
                drawn += points
        self.plotted = {**series, **{f"eval {name}": list(points) for name, points in evals.items()}}
        self._x_axis(drawn)
        self.refresh()


class ForkScreen(Screen):
    """Variants typed here, forked from the pause; the report as a table and curves; keep or discard."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("ctrl+f", "fork", "fork", priority=True),
        Binding("k", "keep", "keep"),
        Binding("s", "save_variant", "save variant"),
        Binding("d", "discard", "discard"),
        Binding("question_mark", "app.help", "help", key_display="?"),
    ]

    def __init__(self) -> None:
        super().__init__(id="fork")
        self.report: dict[str, Any] | None = None
        self.names: list[str] = []  # the table's variant rows, in order (the parent's row is not one)

    def compose(self) -> ComposeResult:
        with Horizontal(id="fork-form"):
            yield TextArea("a:\nb: learning_rate=", id="fork-variants")
            with Vertical(id="fork-side"):
                yield Input("50", id="fork-steps", type="integer", placeholder="steps")
                yield Button("Fork (ctrl+f)", id="fork-go", variant="primary")
        yield Static(FORK_HINT.splitlines()[0], id="fork-head")
        yield DataTable(id="fork-table", cursor_type="row", zebra_stripes=True)
        yield ForkChart(id="fork-chart")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#fork-variants").border_title = "variants"
        self.query_one("#fork-table").border_title = "fork: the final numbers"
        self.show(self.app.session.snapshot().fork)
        text = self.query_one(TextArea)
        text.move_cursor(text.document.end)  # on "b: learning_rate=": type the value
        text.focus()

    # -- actions ---------------------------------------------------------------------------------

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "fork-go":
            self.action_fork()

    def action_fork(self) -> None:
        """Check the text and the memory here (one line on a mistake), then fork in a thread."""
        try:
            variants = parse_variants(self.query_one(TextArea).text)
            steps = int(self.query_one("#fork-steps", Input).value or "0")
            if steps < 1:
                raise ValueError("fork: steps must be a whole number >= 1")
            if self.app.session.status != Status.PAUSED:
                raise ValueError("fork: pause the run first (space)")
            cost = self.app.session.fork_cost(variants, steps)
        except Exception as exc:  # noqa: BLE001 - shown as the one-line refusal it is
            self.notify(str(exc), severity="error")
            return
        if not cost["fits"]:
            self.notify(f"fork: {cost['bytes'] / 2**20:.1f} MiB for {cost['variants']} variants would not fit "
                        f"(limit {cost['limit'] / 2**20:.1f} MiB)", severity="error")
            return
        self.query_one("#fork-head", Static).update(
            f"forking {len(variants)} variants x {steps} steps ({cost['bytes'] / 2**20:.1f} MiB held) ...")
        self.app.log_line("info", f"fork: {len(variants)} variants x {steps} steps from step {self.app.session.snapshot().step}")
        self.app.run_command("fork", lambda: self.app.session.fork(variants, steps))

    def action_keep(self) -> None:
        """Continue the run from the selected variant's state."""
        name = self._selected()
        if name is not None:
            self.app.run_command(f"keep {name}", lambda: self.app.session.keep(name))
            self.app.log_line("info", f"fork: keeping {name}")

    def action_save_variant(self) -> None:
        """Save the selected variant as a checkpoint of its own; the fork stays open."""
        name = self._selected()
        if name is not None:
            self.app.run_command(f"save variant {name}", lambda: self.app.session.save_variant(name))

    def action_discard(self) -> None:
        """Continue from the pause point unchanged."""
        if self._open():
            self.app.run_command("discard", self.app.session.discard)
            self.app.log_line("info", "fork: discarded; the run goes on from the pause unchanged")

    def _open(self) -> bool:
        if not self.report or self.report.get("state") != "done":
            self.notify("no fork to keep, save or discard: fork first", severity="warning")
            return False
        return True

    def _selected(self) -> str | None:
        if not self._open():
            return None
        row = self.query_one(DataTable).cursor_row
        if row is None or not 1 <= row <= len(self.names):
            self.notify("select a variant's row first", severity="warning")
            return None
        return self.names[row - 1]

    # -- showing ---------------------------------------------------------------------------------

    def show(self, report: dict[str, Any] | None) -> None:
        """Show a fork's report (cheap when it did not change)."""
        if report is None or report == self.report:
            return
        self.report = report
        self.query_one("#fork-head", Static).update(fork_summary(report))
        table = self.query_one(DataTable)
        row = table.cursor_row
        # The variant selected stays selected when the report changes under it (a save): k after
        # s must keep the variant just saved, not the first one.
        selected = self.names[row - 1] if row is not None and 1 <= row <= len(self.names) else None
        table.clear(columns=True)
        for column in ("variant", "changes", "train loss", *fork_metrics(report), "same batches"):
            table.add_column(column, key=column)
        rows = fork_rows(report)
        self.names = [row["name"] for row in rows if not row["parent"]]
        for row in rows:
            name = Text(row["name"] + (" ★" if row["kept"] else ""), style="italic" if row["parent"] else "bold")
            table.add_row(name, row["changes"], row["loss"], *row["metrics"], row["same"])
        if len(rows) > 1:
            table.move_cursor(row=1 + self.names.index(selected) if selected in self.names else 1)
        if report.get("state") == "done":
            table.focus()  # k and d act on the table's selection
        series = self.app.session.snapshot().series
        self.query_one(ForkChart).show(fork_series(report, list(series.get("loss", ()))),
                                       fork_eval_series(report, series))
