"""The dashboard's view of proposals: the run's, and an autopilot's in this process (issue 28).

A run keeps the changes proposed to it (``snapshot().proposals``: an autopilot in dry-run mode
in any process puts its proposals there, a script or ``workbench ctl`` too), so ``o`` lists
them on any run, local or attached, with or without an autopilot here: ``y`` (or enter)
accepts the selected one (the run applies it as a live edit naming the proposal) and ``n``
rejects it, through the door's ``decide``. With an Autopilot steering from this process
(``run_dashboard(session, autopilot=...)``), its decisions are listed too (refused, held,
applied, reverted...) and logged as their states change; its proposals are decided through
its own ``accept`` and ``reject`` (which check its limits again and decide the run's copy).
Nothing here decides anything itself.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from workbench.door.callers import calling_as
from workbench.door.values import Proposal

__all__ = ["AutopilotScreen", "AutopilotWatcher", "decision_level", "proposal_rows"]

# How each decision (or proposal) state reads in the event log and the table.
_LEVELS = {"proposed": "warn", "applied": "good", "refused": "warn", "held": "info", "failed": "error",
           "rejected": "info", "superseded": "info", "sent": "info"}
_STYLES = {"proposed": "bold yellow", "pending": "bold yellow", "applied": "green", "refused": "red", "failed": "red",
           "held": "dim", "rejected": "dim", "superseded": "dim", "sent": "cyan", "accepted": "cyan"}


def decision_level(state: str) -> str:
    """The event-log level a decision in ``state`` is shown at."""
    return _LEVELS.get(state, "info")


def _waiting(row: Any) -> bool:
    """Whether a row (an autopilot's decision or a run's proposal) waits for a person."""
    return row.state == ("pending" if isinstance(row, Proposal) else "proposed")


def proposal_rows(proposals: Any, autopilot: Any = None) -> list[Any]:
    """What the screen lists, waiting ones first, newest first within each part: the
    autopilot's decisions (when one is in this process) and the run's proposals, but for those
    the autopilot published itself (its decision stands for them: one row per proposal)."""
    decisions = list(autopilot.decisions) if autopilot is not None else []
    owned = {d.published for d in decisions if getattr(d, "published", None) is not None}
    rows = [*decisions, *(p for p in proposals if p.id not in owned)]
    rows.sort(key=lambda r: (not _waiting(r), -r.time, -r.id))
    return rows


class AutopilotWatcher:
    """Logs an in-process autopilot's decisions as their states change, tells of each new
    proposal on the run, and keeps the proposals screen current (polled with the snapshot: a
    comparison of a counter and of one tuple's identity while nothing changes)."""

    def __init__(self, autopilot: Any) -> None:
        self.autopilot = autopilot
        self.has_proposals = False  # the run has had a proposal: o is offered from then on
        self._version = -1
        self._states: dict[int, str] = {}
        self._proposals: Any = ()
        self._told: set[int] = set()

    def poll(self, app: Any, snapshot: Any = None) -> None:
        """Log each decision whose state changed since the last poll; a new proposal (the
        autopilot's, or one on the run from anyone else) is also a notice."""
        proposals = getattr(snapshot, "proposals", ()) if snapshot is not None else self._proposals
        changed = proposals is not self._proposals
        if changed:
            self._proposals = proposals
            if proposals and not self.has_proposals:
                self.has_proposals = True
                app.refresh_bindings()  # o appears in the footer with the run's first proposal
        pilot = self.autopilot
        if pilot is not None and pilot.version != self._version:
            changed = True
            self._version = pilot.version
            for decision in pilot.decisions:
                if self._states.get(decision.id) == decision.state:
                    continue
                self._states[decision.id] = decision.state
                app.log_line(decision_level(decision.state), f"autopilot {decision.line()}")
                if decision.state == "proposed":
                    app.notify(f"autopilot proposes {decision.change_text}: o to review", timeout=6)
        if not changed:
            return
        owned = {d.published for d in pilot.decisions} if pilot is not None else set()
        for proposal in proposals:
            if proposal.pending and proposal.id not in self._told and proposal.id not in owned:
                self._told.add(proposal.id)
                app.notify(f"proposal {proposal.id} from {proposal.source}: {proposal.change_text}: o to review",
                           timeout=6)
        screen = app.screen
        if isinstance(screen, AutopilotScreen):
            screen.reload(snapshot)


class AutopilotScreen(Screen):
    """The run's proposals (and an in-process autopilot's decisions); accept or reject the selected one."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("y", "accept", "accept"),  # enter too: the table's row selection (on_data_table_row_selected)
        Binding("n", "reject", "reject"),
        Binding("question_mark", "app.help", "help", key_display="?"),
    ]

    def __init__(self, autopilot: Any = None) -> None:
        super().__init__(id="autopilot")
        self.autopilot = autopilot
        self.rows: list[Any] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="autopilot-head")
        yield DataTable(id="autopilot-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="autopilot-reason")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        title = "autopilot: proposals and decisions" if self.autopilot is not None else "the run's proposals"
        self.query_one("#autopilot-table").border_title = title
        self.reload()
        self.query_one(DataTable).focus()

    @property
    def selected(self) -> Any:
        """The decision or proposal under the cursor, or None."""
        table = self.query_one(DataTable)
        if not self.rows or table.cursor_row is None or not 0 <= table.cursor_row < len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def _head(self) -> str:
        pilot = self.autopilot
        if pilot is None:
            return ("[b]the run's proposals[/b] · from any client (an autopilot in dry-run mode, a script, "
                    "workbench ctl); accepting one applies it as a live edit")
        mode = "dry run: proposals wait for you" if pilot.dry_run else "acting within its limits"
        names = ", ".join(getattr(p, "name", type(p).__name__) for p in pilot.policies)
        error = f"\n[red]last poll failed: {pilot.error}[/]" if pilot.error else ""
        return f"[b]{names}[/b] · {mode}\nlimits: {pilot.limits.describe()}{error}"

    def reload(self, snapshot: Any = None) -> None:
        """Show the rows again (waiting ones on top, newest first), keeping the selection."""
        snapshot = snapshot if snapshot is not None else self.app.session.snapshot()
        self.query_one("#autopilot-head", Static).update(self._head())
        previous = self.selected
        previous = (type(previous), previous.id) if previous is not None else None
        self.rows = proposal_rows(getattr(snapshot, "proposals", ()), self.autopilot)
        table = self.query_one(DataTable)
        table.clear(columns=True)
        for column in ("id", "step", "from", "change", "state"):
            table.add_column(column, key=column)
        for row in self.rows:
            run = isinstance(row, Proposal)
            # The run's proposals go by their number (workbench ctl accept N); the autopilot's decisions by #N.
            ident, source = (str(row.id), row.source) if run else (f"#{row.id}", row.policy)
            revert = " (revert)" if getattr(row, "kind", "change") == "revert" else ""
            table.add_row(Text(ident, justify="right"), Text(str(row.step), justify="right"), source,
                          row.change_text + revert, Text(row.state, style=_STYLES.get(row.state, "")),
                          key=f"{'run' if run else 'pilot'}-{row.id}")
        if self.rows:
            keys = [(type(r), r.id) for r in self.rows]
            table.move_cursor(row=keys.index(previous) if previous in keys else 0)
        self.show_reason()

    def show_reason(self) -> None:
        """The selected row's reason and what became of it, under the table."""
        row = self.selected
        if row is None:
            self.query_one("#autopilot-reason", Static).update("no proposals yet")
            return
        if isinstance(row, Proposal):
            text = f"proposal {row.id} from {row.source}: {row.reason or '(no reason given)'}"
            if not row.pending:
                text += f"\n{row.state} by {row.decided_by}" + (f": {row.decision}" if row.decision else "")
                text += f" ({row.note})" if row.note else ""
        else:
            text = f"#{row.id}: {row.reason}" + (f"\n{row.note}" if row.note else "")
        if _waiting(row):
            text += "\n[b]y[/b] accept · [b]n[/b] reject"
        self.query_one("#autopilot-reason", Static).update(text)

    def on_data_table_row_highlighted(self, _message: DataTable.RowHighlighted) -> None:
        self.show_reason()

    def on_data_table_row_selected(self, _message: DataTable.RowSelected) -> None:
        self.action_accept()

    def _proposal(self) -> Any:
        row = self.selected
        if row is None or not _waiting(row):
            self.notify("select a proposal waiting for an answer (pending, proposed) first", severity="warning")
            return None
        return row

    def _decide(self, proposal: Proposal, accept: bool) -> None:
        """Decide one of the run's proposals, in a thread (a remote run answers over a socket),
        as the dashboard (the run records who decided)."""
        session = self.app.session

        def decide() -> Any:
            with calling_as("dashboard"):
                return session.decide(proposal.id, accept, reason=None if accept else "rejected in the dashboard")

        self.app.run_command("accept proposal" if accept else "reject proposal", decide)

    def action_accept(self) -> None:
        """Accept the selected proposal (the autopilot's: it checks its limits again and sends it)."""
        row = self._proposal()
        if isinstance(row, Proposal):
            self._decide(row, True)
        elif row is not None:
            self.app.run_command("autopilot accept", lambda: self.autopilot.accept(row.id))

    def action_reject(self) -> None:
        """Reject the selected proposal: nothing is sent."""
        row = self._proposal()
        if isinstance(row, Proposal):
            self._decide(row, False)
        elif row is not None:
            self.app.run_command("autopilot reject", lambda: self.autopilot.reject(row.id, "rejected in the dashboard"))
