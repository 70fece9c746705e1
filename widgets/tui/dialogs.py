"""Small modal dialogs: quit (stop and save / stop without saving / cancel) and yes/no."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

__all__ = ["QuitDialog", "ConfirmDialog"]

_MOVE = [
    Binding("escape", "cancel", "cancel"),
    Binding("left,up", "app.focus_previous", show=False),
    Binding("right,down", "app.focus_next", show=False),
]


class QuitDialog(ModalScreen[str]):
    """Ask how to leave a running run. Dismisses with "save", "discard", "detach" or "cancel".

    "Stop and save" has the focus, so q then Enter always keeps the work;
    Escape cancels. On an attached run (``attached``) "Detach" comes first and has the
    focus: q then Enter leaves the run going, and stopping it is an explicit choice.
    """

    BINDINGS = _MOVE
    AUTO_FOCUS = "#quit-save"

    def __init__(self, step: int, attached: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self.step = step
        self.attached = attached
        if attached:
            self.AUTO_FOCUS = "#quit-detach"

    def _text(self) -> str:
        question = "Detach (the run goes on) or stop it?" if self.attached else "Stop it and quit?"
        return f"The run is at step {self.step}. {question}"

    def set_step(self, step: int) -> None:
        """The run goes on while the dialog is open: show the step it is at now, which is
        where a stop chosen now takes it (the app calls this on every poll)."""
        if step != self.step:
            self.step = step
            texts = self.query("#quit-text")
            if texts:
                texts.first(Static).update(self._text())

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self._text(), classes="dialog-text", id="quit-text")
            with Horizontal(classes="dialog-buttons"):
                if self.attached:
                    yield Button("Detach", id="quit-detach", variant="primary")
                yield Button("Stop and save", id="quit-save", variant="default" if self.attached else "primary")
                yield Button("Stop without saving", id="quit-discard", variant="error")
                yield Button("Cancel", id="quit-cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss((event.button.id or "quit-cancel").removeprefix("quit-"))

    def action_cancel(self) -> None:
        """Escape: keep the run going."""
        self.dismiss("cancel")


class ConfirmDialog(ModalScreen[bool]):
    """A yes/no question; the safe answer ("No") has the focus unless ``default_yes``."""

    BINDINGS = _MOVE

    def __init__(self, question: str, yes: str = "Yes", default_yes: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self.question = question
        self.yes = yes
        self.default_yes = default_yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="dialog-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, id="confirm-yes", variant="warning")
                yield Button("No", id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-yes" if self.default_yes else "#confirm-no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm-yes")

    def action_cancel(self) -> None:
        """Escape: no."""
        self.dismiss(False)
