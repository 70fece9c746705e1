"""Modal forms: live hyperparameter edits and the overrides of a branch.

The forms send what the user typed to the session, which reads and checks it (the same
checks as ``session.set()`` and ``session.branch()`` in a script, and the notebook
panel's); a refusal keeps the form open with the session's one-line reason, so a typo
never reaches the run.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from workbench.door.protocol import CheckpointRow, SessionLike, Snapshot
from workbench.widgets.view import fmt_lr

from .charts import PlanChart

__all__ = ["EditForm", "BranchForm", "EDIT_FIELDS"]

# (key, label): the live edits the form offers, in the order it shows them.
EDIT_FIELDS: tuple[tuple[str, str], ...] = (
    ("learning_rate", "learning rate"),
    ("lr_scale", "or scale LR by"),
    ("max_steps", "max steps"),
    ("eval_steps", "eval every"),
    ("save_steps", "save every"),
    ("logging_steps", "log every"),
    ("schedule", "or the schedule"),  # a change of its shape, as typed: "decay_now steps=200 to=min_lr"
)
SCHEDULE_HINT = "decay_now steps=200 [to=min_lr shape=cosine] | extend max_steps=N | rewarm steps=N peak=LR"


class _Form(ModalScreen):
    """Shared behaviour: Escape cancels, Enter in any field submits, errors show in red."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def error(self, message: str) -> None:
        """Show why the input was refused (and keep the form open)."""
        self.query_one(".form-error", Static).update(message)

    def action_cancel(self) -> None:
        """Close without changing anything."""
        self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "form-ok":
            self.submit()
        else:
            self.dismiss(None)

    def submit(self) -> None:  # pragma: no cover - every form overrides it
        raise NotImplementedError

    def buttons(self, ok: str, compact: bool = False) -> ComposeResult:
        yield Static("", classes="form-error")
        with Horizontal(classes="dialog-buttons"):
            yield Button(ok, id="form-ok", variant="primary", compact=compact)
            yield Button("Cancel", id="form-cancel", compact=compact)


class EditForm(_Form):
    """Change hyperparameters of the running (or paused) session.

    Dismisses with ``(changes, result)`` where result is what ``session.set`` returned (a
    Future while running: the edit lands at the next step end), or None when cancelled.
    """

    def __init__(self, session: SessionLike, snapshot: Snapshot | None) -> None:
        super().__init__(classes="dialog-screen")
        self.session = session
        self.snapshot = snapshot

    def _placeholder(self, key: str) -> str:
        snap = self.snapshot
        if key == "learning_rate":
            lr = snap.latest("learning_rate") if snap is not None else None
            return f"now {fmt_lr(lr)}" if lr is not None else "e.g. 1e-4"
        if key == "lr_scale":
            return "e.g. 0.5"
        if key == "max_steps" and snap is not None and snap.max_steps:
            return f"now {snap.max_steps}"
        if key == "schedule":
            return SCHEDULE_HINT
        return "unchanged"

    def compose(self) -> ComposeResult:
        # Compact (no gaps, one-line buttons): the form and its preview fit an 80x24 terminal.
        with Vertical(classes="dialog form edit"):
            yield Static("Change hyperparameters (applied at the next step boundary)", classes="dialog-text")
            for key, label in EDIT_FIELDS:
                with Horizontal(classes="form-row"):
                    yield Label(label, classes="form-label")
                    yield Input(placeholder=self._placeholder(key), id=f"edit-{key}", classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("why (optional)", classes="form-label")
                yield Input(placeholder="kept with the edit, e.g. eval loss flat for 3 evaluations", id="edit-reason",
                            classes="form-input", compact=True)
            yield Static("planned learning rate: [green]now[/] [yellow]after the schedule change[/] (dashed)",
                         id="plan-title")
            yield PlanChart(id="plan-chart")
            yield from self.buttons("Apply", compact=True)

    def on_mount(self) -> None:
        # Focus before the first paint: a key typed as soon as the form shows lands in its
        # first field (the screen's own auto-focus can come a frame later, and Tab then
        # starts from nothing and ends one field short).
        self.query_one("#edit-learning_rate", Input).focus()
        self.preview("")

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "edit-schedule":
            self.preview(event.value)

    def preview(self, text: str) -> None:
        """Draw the rest of the run's learning rate now and after the typed schedule change
        (nothing is applied); a change the run would refuse shows its reason instead."""
        try:
            now = self.session.lr_plan()
            proposed = self.session.lr_plan(text) if text.strip() else ()
        except (ValueError, RuntimeError) as exc:
            self.error(str(exc))
            return
        self.error("")
        self.query_one(PlanChart).show(now, proposed)

    def submit(self) -> None:
        """Send the filled-in fields (empty ones keep their value); keep the form open on any refusal."""
        texts = {key: self.query_one(f"#edit-{key}", Input).value.strip() for key, _label in EDIT_FIELDS}
        reason = self.query_one("#edit-reason", Input).value.strip() or None
        try:
            changes = self.session.validate_edits({key: text for key, text in texts.items() if text})
            result = self.session.set(**changes, **({"reason": reason} if reason else {}))
        except (ValueError, RuntimeError) as exc:
            self.error(str(exc))
            return
        self.dismiss((changes, result))


class BranchForm(_Form):
    """Ask for the overrides of a branch: output_dir, learning rate, max steps, any other argument.

    Dismisses with ``(output_dir, overrides)`` once ``session.check_branch`` accepts them, or None.
    """

    def __init__(self, session: SessionLike, checkpoint: CheckpointRow) -> None:
        super().__init__(classes="dialog-screen")
        self.session = session
        self.checkpoint = checkpoint
        self.args = session.arguments()

    def compose(self) -> ComposeResult:
        default_dir = f"{Path(self.args['output_dir'])}-branch-{self.checkpoint.step}"
        with Vertical(classes="dialog form"):
            yield Static(f"Branch from {self.checkpoint.name} into a new run", classes="dialog-text")
            with Horizontal(classes="form-row"):
                yield Label("output dir", classes="form-label")
                yield Input(value=default_dir, id="branch-output_dir", classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("learning rate", classes="form-label")
                yield Input(placeholder=f"now {fmt_lr(self.args.get('learning_rate'))}", id="branch-learning_rate",
                            classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("max steps", classes="form-label")
                yield Input(placeholder=f"now {self.args.get('max_steps')}", id="branch-max_steps",
                            classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("other", classes="form-label")
                yield Input(placeholder="key=value, key=value", id="branch-other", classes="form-input", compact=True)
            yield from self.buttons("Branch")

    def submit(self) -> None:
        """Have the session check the branch (folder, overrides, arguments) before anything stops."""
        value = lambda key: self.query_one(f"#branch-{key}", Input).value.strip()  # noqa: E731
        output_dir = value("output_dir")
        try:
            overrides = self.session.parse_overrides(value("other"))
            overrides.update(self.session.parse_overrides({"learning_rate": value("learning_rate"),
                                                           "max_steps": value("max_steps")}))
            overrides = self.session.check_branch(self.checkpoint.path, output_dir, **overrides)
        except (ValueError, RuntimeError) as exc:
            self.error(str(exc))
            return
        self.dismiss((output_dir, overrides))
