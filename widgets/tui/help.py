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
  a           samples: hide or show the answers to the run's prompts
              (the panel appears with the first ones; [samples])
  f           fork: A/B variants from the pause, each trained on the
              same batches; then keep one or discard the fork
  o           autopilot (when one steers the run): its proposals and
              decisions; y / enter accepts a proposal, n rejects it
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

[b]Fork[/b]
  type variants, a line each (b: learning_rate=1e-3), and the steps
  ctrl+f      fork from the paused run (the memory is checked first)
  k           keep the selected variant: the run continues from it
  d           discard: the run continues from the pause unchanged
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
