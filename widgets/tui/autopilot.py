"""The dashboard's view of an autopilot (``run_dashboard(session, autopilot=...)``, issue 28).

The autopilot is a client of the run like the dashboard, in the same process: it keeps its
decisions and, in dry-run mode, its proposals. The dashboard logs each decision as its state
changes (proposed, applied, refused, reverted...) and ``o`` opens this screen: the proposals
and decisions as a table, where ``y`` (or enter) accepts the selected proposal (the autopilot
checks it against its limits again and sends it with its reason) and ``n`` rejects it.
Nothing here decides anything: the screen only calls ``accept`` and ``reject``.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

__all__ = ["AutopilotScreen", "AutopilotWatcher", "decision_level"]

# How each decision state reads in the event log and the table.
_LEVELS = {"proposed": "warn", "applied": "good", "refused": "warn", "held": "info", "failed": "error",
           "rejected": "info", "superseded": "info", "sent": "info"}
_STYLES = {"proposed": "bold yellow", "applied": "green", "refused": "red", "failed": "red", "held": "dim",
           "rejected": "dim", "superseded": "dim", "sent": "cyan"}


def decision_level(state: str) -> str:
    """The event-log level a decision in ``state`` is shown at."""
    return _LEVELS.get(state, "info")


class AutopilotWatcher:
    """Logs an autopilot's decisions in the dashboard as their states change (polled with the
    snapshot: a comparison of one counter while nothing changes)."""

    def __init__(self, autopilot: Any) -> None:
        self.autopilot = autopilot
        self._version = -1
        self._states: dict[int, str] = {}

    def poll(self, app: Any) -> None:
        """Log each decision whose state changed since the last poll; a new proposal is also a notice."""
        if self.autopilot is None or self.autopilot.version == self._version:
            return
        self._version = self.autopilot.version
        for decision in self.autopilot.decisions:
            if self._states.get(decision.id) == decision.state:
                continue
            self._states[decision.id] = decision.state
            app.log_line(decision_level(decision.state), f"autopilot {decision.line()}")
            if decision.state == "proposed":
                app.notify(f"autopilot proposes {decision.change_text}: o to review", timeout=6)
        screen = app.screen
        if isinstance(screen, AutopilotScreen):
            screen.reload()


class AutopilotScreen(Screen):
    """The autopilot's proposals and decisions; accept or reject the selected proposal."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("y", "accept", "accept"),  # enter too: the table's row selection (on_data_table_row_selected)
        Binding("n", "reject", "reject"),
        Binding("question_mark", "app.help", "help", key_display="?"),
    ]

    def __init__(self, autopilot: Any) -> None:
        super().__init__(id="autopilot")
        self.autopilot = autopilot
        self.rows: list[Any] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="autopilot-head")
        yield DataTable(id="autopilot-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="autopilot-reason")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#autopilot-table").border_title = "autopilot: proposals and decisions"
        self.reload()
        self.query_one(DataTable).focus()

    @property
    def selected(self) -> Any:
        """The decision under the cursor, or None."""
        table = self.query_one(DataTable)
        if not self.rows or table.cursor_row is None or not 0 <= table.cursor_row < len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def reload(self) -> None:
        """Show the decisions again (newest first, pending proposals on top), keeping the selection."""
        pilot = self.autopilot
        mode = "dry run: proposals wait for you" if pilot.dry_run else "acting within its limits"
        names = ", ".join(getattr(p, "name", type(p).__name__) for p in pilot.policies)
        error = f"\n[red]last poll failed: {pilot.error}[/]" if pilot.error else ""
        self.query_one("#autopilot-head", Static).update(
            f"[b]{names}[/b] · {mode}\nlimits: {pilot.limits.describe()}{error}")
        previous = self.selected.id if self.selected is not None else None
        decisions = list(reversed(pilot.decisions))
        self.rows = [d for d in decisions if d.state == "proposed"] + [d for d in decisions if d.state != "proposed"]
        table = self.query_one(DataTable)
        table.clear(columns=True)
        for column in ("#", "step", "policy", "change", "state"):
            table.add_column(column, key=column)
        for d in self.rows:
            table.add_row(Text(str(d.id), justify="right"), Text(str(d.step), justify="right"), d.policy,
                          d.change_text + (" (revert)" if d.kind == "revert" else ""),
                          Text(d.state, style=_STYLES.get(d.state, "")), key=str(d.id))
        if self.rows:
            ids = [d.id for d in self.rows]
            table.move_cursor(row=ids.index(previous) if previous in ids else 0)
        self.show_reason()

    def show_reason(self) -> None:
        """The selected decision's reason and note, under the table."""
        d = self.selected
        text = "no decisions yet" if d is None else f"#{d.id}: {d.reason}" + (f"\n{d.note}" if d.note else "")
        if d is not None and d.state == "proposed":
            text += "\n[b]y[/b] accept · [b]n[/b] reject"
        self.query_one("#autopilot-reason", Static).update(text)

    def on_data_table_row_highlighted(self, _message: DataTable.RowHighlighted) -> None:
        self.show_reason()

    def on_data_table_row_selected(self, _message: DataTable.RowSelected) -> None:
        self.action_accept()

    def _proposal(self) -> Any:
        d = self.selected
        if d is None or d.state != "proposed":
            self.notify("select a proposal (state proposed) first", severity="warning")
            return None
        return d

    def action_accept(self) -> None:
        """Accept the selected proposal: the autopilot checks it again and sends it (in a thread)."""
        d = self._proposal()
        if d is not None:
            self.app.run_command("autopilot accept", lambda: self.autopilot.accept(d.id))

    def action_reject(self) -> None:
        """Reject the selected proposal: nothing is sent."""
        d = self._proposal()
        if d is not None:
            self.autopilot.reject(d.id, "rejected in the dashboard")
            self.reload()
