"""The checkpoints screen: the catalog as a table, details of the selected one, and actions
(resume from it, branch from it, delete it). Under ``workbench watch`` (a read-only
dashboard) it is a catalog only: the actions are neither offered nor run."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from workbench.door.protocol import ENDED, CheckpointRow, Status
from workbench.widgets.view import fmt_age, fmt_bytes, fmt_number

from .details import checkpoint_details, key_metrics
from .dialogs import ConfirmDialog
from .forms import BranchForm

__all__ = ["CheckpointsScreen", "CHECKPOINT_ACTIONS"]

# The screen's actions that change the run or its folder: a read-only dashboard hides them.
CHECKPOINT_ACTIONS = frozenset({"resume", "branch", "delete"})


class CatalogTable(DataTable):
    """A row table where home/end go to the first/last row (the oldest/newest checkpoint)."""

    BINDINGS = [
        Binding("home", "scroll_top", "first", show=False),
        Binding("end", "scroll_bottom", "last", show=False),
    ]


class CheckpointsScreen(Screen):
    """Browse ``session.checkpoints`` and act on one."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("r", "resume", "resume from"),
        Binding("b", "branch", "branch"),
        Binding("d,delete", "delete", "delete"),
        Binding("question_mark", "app.help", "help", key_display="?"),
    ]

    def __init__(self) -> None:
        super().__init__(id="checkpoints")
        self.rows: list[CheckpointRow] = []
        self._catalog: Any = None

    def compose(self) -> ComposeResult:
        # Stacked, not side by side: the table needs the full width of an 80-column terminal.
        yield CatalogTable(id="ckpt-table", cursor_type="row", zebra_stripes=True)
        with VerticalScroll(id="ckpt-detail-box"):
            yield Static("", id="ckpt-detail")
        yield Footer(compact=True)

    @property
    def read_only(self) -> bool:
        """Whether the dashboard only watches the run (``workbench watch``)."""
        return bool(getattr(self.app, "read_only", False))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A watched run's catalog offers no action on it: the footer hides them and their
        keys do nothing (steering is for workbench attach and workbench ctl)."""
        return not (self.read_only and action in CHECKPOINT_ACTIONS)

    def on_mount(self) -> None:
        self.query_one("#ckpt-table").border_title = "checkpoints (read-only)" if self.read_only else "checkpoints"
        self.query_one("#ckpt-detail-box").border_title = "details"
        self.reload()
        self.query_one(DataTable).focus()

    # -- data ----------------------------------------------------------------------------------

    @property
    def selected(self) -> CheckpointRow | None:
        """The catalog row under the cursor, or None."""
        table = self.query_one(DataTable)
        if not self.rows or table.cursor_row is None or not 0 <= table.cursor_row < len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def reload(self) -> None:
        """Re-read the catalog from disk (cheap: small JSON files), keeping the selection."""
        previous = self.selected.name if self.rows and self.selected is not None else None
        self.rows = list(self.app.session.checkpoints)
        table = self.query_one(DataTable)
        metrics = key_metrics(self.rows)
        table.clear(columns=True)
        table.add_column("step", key="step")
        for name in metrics:
            table.add_column(name.removeprefix("eval_") if name != "eval_loss" else "eval_loss", key=name)
        table.add_column("size", key="size")
        table.add_column("age", key="age")
        table.add_column("best", key="best")
        table.add_column("complete", key="complete")
        now = self.app.now()
        for info in self.rows:
            cells = [Text(str(info.step), justify="right")]
            cells += [Text(fmt_number(info.metrics.get(m)), justify="right") for m in metrics]
            cells += [Text(fmt_bytes(info.size), justify="right"), fmt_age(info.created, now).removesuffix(" ago"),
                      Text("★", style="bold yellow") if info.best else "",
                      Text("yes", style="green") if info.complete else Text("no", style="red")]
            table.add_row(*cells, key=info.name)
        if not self.rows:
            self.query_one("#ckpt-detail", Static).update(
                "No checkpoints." if self.read_only else "No checkpoints yet: press escape, then s to save one.")
            return
        names = [r.name for r in self.rows]
        table.move_cursor(row=names.index(previous) if previous in names else len(names) - 1)
        self.show_details()

    def show(self, snapshot: Any, frozen: bool = False) -> None:
        """Called by the app on each new snapshot: reload when the catalog changed (a save)."""
        if snapshot.checkpoints is not self._catalog:
            first = self._catalog is None
            self._catalog = snapshot.checkpoints
            if not first:
                self.reload()

    def show_details(self) -> None:
        """Fill the detail pane for the selected checkpoint."""
        info = self.selected
        if info is None:
            return
        current = self.app.session.arguments()
        self.query_one("#ckpt-detail", Static).update("\n".join(checkpoint_details(info, current)))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_details()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if not self.read_only:  # enter is "resume from" only where the run can be steered
            self.action_resume()

    # -- actions -------------------------------------------------------------------------------

    def action_resume(self) -> None:
        """Resume this run from the selected checkpoint (after confirming: the current run stops)."""
        info = self.selected
        if info is None:
            return
        if not info.complete:
            self.notify(f"{info.name} is incomplete; it cannot be resumed from", severity="error")
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.app.resume_from(info)

        running = self.app.session.status not in ENDED and self.app.session.status != Status.IDLE
        question = f"Resume from {info.name}?"
        if running:
            question += "\nThe current run stops now, without saving."
        self.app.push_screen(ConfirmDialog(question, yes="Resume", default_yes=True), confirmed)

    def action_branch(self) -> None:
        """Start a new run from the selected checkpoint, with the overrides the form asks for."""
        info = self.selected
        if info is None or not info.complete:
            self.notify("choose a complete checkpoint to branch from", severity="error")
            return

        def chosen(result: tuple[str, dict] | None) -> None:
            if result is not None:
                self.app.branch_from(info, *result)

        self.app.push_screen(BranchForm(self.app.session, info), chosen)

    def action_delete(self) -> None:
        """Delete the selected checkpoint after confirmation, through the session (which
        refuses the best, the newest complete one and the one the run resumes from)."""
        info = self.selected
        if info is None:
            return
        if info.protected:  # the row says so already: refuse without asking (the session would too)
            self.notify(f"{info.name} is protected (the best or the newest checkpoint)", severity="error")
            return

        def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            try:
                self.app.session.delete_checkpoint(info.name)  # logged by the session's "deleted" event
            except (OSError, ValueError, RuntimeError) as exc:
                self.notify(str(exc), severity="error")
            self.reload()

        self.app.push_screen(ConfirmDialog(f"Delete {info.name} ({fmt_bytes(info.size)})? This cannot be undone.",
                                           yes="Delete"), confirmed)
