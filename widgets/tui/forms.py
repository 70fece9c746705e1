"""Modal forms: live hyperparameter edits and the overrides of a branch.

Input is checked in the form, and a refused value keeps the form open with the reason, so a
typo never reaches the run. The parsing is in plain functions so it is testable alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from workbench.train.edits import EDITABLE
from workbench.widgets.view import fmt_lr

__all__ = ["EditForm", "BranchForm", "parse_edits", "parse_overrides"]

# (key, label, type): the live edits a Session accepts, in the order the form shows them.
EDIT_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("learning_rate", "learning rate", float),
    ("lr_scale", "or scale LR by", float),
    ("max_steps", "max steps", int),
    ("eval_steps", "eval every", int),
    ("save_steps", "save every", int),
    ("logging_steps", "log every", int),
)


def _number(key: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{key}: {text!r} is not {what}") from None


def parse_edits(texts: dict[str, str], current_step: int = 0) -> dict[str, Any]:
    """The edits typed into the form, parsed and checked; raises ValueError with the reason.

    Empty fields keep their value. The checks are the Session's own (``EDITABLE``) plus the
    ones only the form can make early: one way of changing the LR at a time, and max_steps
    not below the step the run has already reached.
    """
    changes: dict[str, Any] = {}
    for key, _label, kind in EDIT_FIELDS:
        text = texts.get(key, "").strip()
        if not text:
            continue
        value = _number(key, text, kind)
        EDITABLE[key](value)
        changes[key] = value
    if "learning_rate" in changes and "lr_scale" in changes:
        raise ValueError("set the learning rate or scale it, not both")
    if "max_steps" in changes and changes["max_steps"] < current_step:
        raise ValueError(f"max_steps: {changes['max_steps']} is below the current step {current_step}")
    if not changes:
        raise ValueError("nothing to change: fill in at least one field")
    return changes


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

    def buttons(self, ok: str) -> ComposeResult:
        yield Static("", classes="form-error")
        with Horizontal(classes="dialog-buttons"):
            yield Button(ok, id="form-ok", variant="primary")
            yield Button("Cancel", id="form-cancel")


class EditForm(_Form):
    """Change hyperparameters of the running (or paused) session.

    Dismisses with ``(changes, result)`` where result is what ``Session.set`` returned (a
    Future while running: the edit lands at the next step end), or None when cancelled.
    """

    def __init__(self, session: Any, snapshot: Any) -> None:
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
        return "unchanged"

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog form"):
            yield Static("Change hyperparameters (applied at the next step boundary)", classes="dialog-text")
            for key, label, _kind in EDIT_FIELDS:
                with Horizontal(classes="form-row"):
                    yield Label(label, classes="form-label")
                    yield Input(placeholder=self._placeholder(key), id=f"edit-{key}", classes="form-input", compact=True)
            yield from self.buttons("Apply")

    def submit(self) -> None:
        """Parse, check and send the edits; keep the form open on any refusal."""
        texts = {key: self.query_one(f"#edit-{key}", Input).value for key, _l, _k in EDIT_FIELDS}
        step = self.snapshot.step if self.snapshot is not None else 0
        try:
            changes = parse_edits(texts, step)
            result = self.session.set(**changes)
        except (ValueError, RuntimeError) as exc:
            self.error(str(exc))
            return
        self.dismiss((changes, result))


def parse_overrides(text: str) -> dict[str, Any]:
    """``"warmup_steps=10, lr_scheduler_type=linear"`` -> a dict (values read as TOML, as ``--set``)."""
    from workbench.config.loader import parse_override

    overrides: dict[str, Any] = {}
    for part in (p.strip() for p in text.replace("\n", ",").split(",")):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"{part!r}: expected key=value")
        key, value = parse_override(part)
        overrides[key.removeprefix("training.")] = value
    return overrides


class BranchForm(_Form):
    """Ask for the overrides of a branch: output_dir, learning rate, max steps, any other argument.

    Dismisses with ``(output_dir, overrides)`` once the new arguments validate, or None.
    """

    def __init__(self, args: Any, checkpoint: Any) -> None:
        super().__init__(classes="dialog-screen")
        self.args = args
        self.checkpoint = checkpoint

    def compose(self) -> ComposeResult:
        default_dir = f"{Path(self.args.output_dir)}-branch-{self.checkpoint.step}"
        with Vertical(classes="dialog form"):
            yield Static(f"Branch from {self.checkpoint.name} into a new run", classes="dialog-text")
            with Horizontal(classes="form-row"):
                yield Label("output dir", classes="form-label")
                yield Input(value=default_dir, id="branch-output_dir", classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("learning rate", classes="form-label")
                yield Input(placeholder=f"now {fmt_lr(self.args.learning_rate)}", id="branch-learning_rate",
                            classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("max steps", classes="form-label")
                yield Input(placeholder=f"now {self.args.max_steps}", id="branch-max_steps", classes="form-input", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("other", classes="form-label")
                yield Input(placeholder="key=value, key=value", id="branch-other", classes="form-input", compact=True)
            yield from self.buttons("Branch")

    def submit(self) -> None:
        """Check the overrides against TrainingArguments' own validation before anything stops."""
        from workbench.checkpoint.store import CheckpointStore

        value = lambda key: self.query_one(f"#branch-{key}", Input).value.strip()  # noqa: E731
        output_dir = value("output_dir")
        try:
            if not output_dir:
                raise ValueError("output dir: required")
            overrides = parse_overrides(value("other"))
            if value("learning_rate"):
                overrides["learning_rate"] = _number("learning_rate", value("learning_rate"), float)
            if value("max_steps"):
                overrides["max_steps"] = _number("max_steps", value("max_steps"), int)
            overrides.pop("output_dir", None)
            if Path(output_dir).resolve() == Path(self.args.output_dir).resolve():
                raise ValueError("output dir: a branch needs its own folder")
            if any(c.complete for c in CheckpointStore(output_dir).list()):
                raise ValueError(f"output dir: {output_dir} already holds checkpoints")
            try:
                dataclasses.replace(self.args, output_dir=output_dir, **overrides)
            except TypeError as exc:
                raise ValueError(f"unknown argument: {exc}") from None
        except ValueError as exc:
            self.error(str(exc))
            return
        self.dismiss((output_dir, overrides))
