"""The ``?`` screen: every key, what it does, and what the screens show."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

__all__ = ["HelpScreen", "HELP_TEXT"]

HELP_TEXT = """\
[b]Main screen[/b]
  space / p   pause or resume at the next step boundary
  s           save a checkpoint now
  e           evaluate now (a new point on the loss chart)
  l           edit hyperparameters: learning rate or LR scale, max
              steps, eval / save / logging intervals (at a step end)
  c           checkpoints: browse, resume from one, branch, delete
  i           inspect the paused model (pauses a running run first)
  y           loss chart: linear or log y axis
  m           loss chart: smoothing on or off
  q           quit: stop and save (enter), stop without saving,
              or cancel (escape); a finished run quits at once
  ctrl+c      stop and save, then exit (twice: exit at once)
  ?           this help

[b]Checkpoints[/b]
  r / enter   resume this run from the selected checkpoint
  b           branch: a new run from it, with changed arguments
  d / delete  delete it (the best and the newest are protected)
  home / end  the oldest / the newest
  escape      back

[b]Inspect[/b]
  type a prompt and press enter to sample from the paused model
  r           read the model again
  escape      back (the run stays paused: space resumes it)

escape or ? closes this help
"""


class HelpScreen(ModalScreen[None]):
    """Key reference."""

    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Static(HELP_TEXT)
