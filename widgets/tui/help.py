"""The ``?`` screen: every key, what it does, and what the screens show.

A read-only dashboard (``workbench watch``) lists only the keys it has: no pause, save,
edit, inspect or fork, no checkpoint actions, and q leaves. Both texts are made from one
table, so a key's words are written once."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

__all__ = ["HelpScreen", "HELP_TEXT", "WATCH_HELP_TEXT", "help_text"]

# Who sees a row: everyone, only a dashboard that steers the run, only a read-only one.
_ALL, _STEER, _WATCH = "all", "steer", "watch"

# (section, [(keys or None for a line of its own, what they do, who sees it)]). A section
# whose rows are all _STEER (fork, inspect: screens a watched run never opens) is left out
# of the read-only help with them.
_SECTIONS: list[tuple[str, list[tuple[str | None, str, str]]]] = [
    ("Main screen", [
        ("space / p", "pause or resume at the next step boundary", _STEER),
        ("s", "save a checkpoint now", _STEER),
        ("e", "evaluate now (a new point on the loss chart)", _STEER),
        ("l", "edit hyperparameters: learning rate or LR scale, max\n"
              "steps, eval / save / logging intervals (at a step end)", _STEER),
        ("c", "checkpoints: browse, resume from one, branch, delete", _STEER),
        ("c", "checkpoints: browse them and their details", _WATCH),
        ("i", "inspect the paused model (pauses a running run first)", _STEER),
        ("y", "loss chart: linear or log y axis", _ALL),
        ("m", "loss chart: smoothing on or off", _ALL),
        ("a", "samples: hide or show the answers to the run's prompts\n"
              "(the panel appears with the first ones; [samples])", _ALL),
        ("f", "fork: A/B variants from the pause, each trained on the\n"
              "same batches; then keep one (k), save one to a folder\n"
              "of its own (s) or discard the fork (d)", _STEER),
        ("o", "proposals (once the run has one, or an autopilot steers\n"
              "from here): y / enter accepts one, n rejects it", _STEER),
        ("q", "quit: stop and save (enter), stop without saving,\n"
              "or cancel (escape); a finished run quits at once", _STEER),
        ("ctrl+c", "stop and save, then exit (twice: exit at once)", _STEER),
        ("q / ctrl+c", "leave; the run is not affected", _WATCH),
        ("?", "this help", _ALL),
    ]),
    ("Checkpoints", [
        ("r / enter", "resume this run from the selected checkpoint", _STEER),
        ("b", "branch: a new run from it, with changed arguments", _STEER),
        ("d / delete", "delete it (the best and the newest are protected)", _STEER),
        ("home / end", "the oldest / the newest", _ALL),
        ("escape", "back", _ALL),
    ]),
    ("Fork", [
        (None, "type variants, a line each (b: learning_rate=1e-3), and the steps", _STEER),
        ("ctrl+f", "fork from the paused run (the memory is checked first)", _STEER),
        ("k", "keep the selected variant: the run continues from it", _STEER),
        ("d", "discard: the run continues from the pause unchanged", _STEER),
        ("escape", "back", _STEER),
    ]),
    ("Inspect", [
        (None, "type a prompt and press enter to sample from the paused model", _STEER),
        ("r", "read the model again", _STEER),
        ("escape", "back (the run stays paused: space resumes it)", _STEER),
    ]),
]
_KEYS = 12  # the key column's width
_WATCHING = ("read-only (workbench watch): to steer the run, use\n"
             "workbench attach OUTDIR or workbench ctl OUTDIR COMMAND")


def help_text(read_only: bool = False) -> str:
    """The key reference as the help screen shows it; ``read_only``: ``workbench watch``'s,
    which lists no key that steers the run (it has none)."""
    shown = {_ALL, _WATCH if read_only else _STEER}
    parts = []
    for title, rows in _SECTIONS:
        lines = []
        for keys, what, who in rows:
            if who not in shown:
                continue
            first, *more = what.split("\n")
            lines.append(f"  {first}" if keys is None else f"  {keys:<{_KEYS}}{first}")
            lines += [" " * (2 + _KEYS) + line for line in more]
        if lines:
            parts.append("\n".join([f"[b]{title}[/b]", *lines]))
    if read_only:
        parts.append(_WATCHING)
    return "\n\n".join(parts) + "\n\nescape or ? closes this help\n"


HELP_TEXT = help_text()
WATCH_HELP_TEXT = help_text(read_only=True)


class HelpScreen(ModalScreen[None]):
    """Key reference (``read_only``: a watched run's, without the steering keys)."""

    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "close")]

    def __init__(self, read_only: bool = False) -> None:
        super().__init__()
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Static(help_text(self.read_only), id="help-text")
