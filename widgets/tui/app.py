"""The dashboard app: a thin view over a session (``SessionLike``) that also steers it.

Threading (docs/architecture.md, section 5):

- the training thread never calls into the app; the app *polls* ``session.snapshot()`` (an
  immutable object swapped atomically) with ``set_interval`` at 4 Hz (3 Hz attached);
- events reach the app through ``EventBridge``, a thread that polls the session's
  ``events_since()`` and posts what each poll found with ``post_message`` (thread-safe);
- commands that may take a while (save or evaluate while paused, waiting for a stop) run in
  short-lived threads that report back with ``post_message`` too. Quick commands (pause,
  resume, stop, queuing a save) are called directly: they only set flags.

So the UI never blocks training, and training never blocks the UI.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding

from workbench.door.protocol import CheckpointRow, SessionLike, Snapshot, Status
from workbench.widgets.view import TERMINAL, edit_text, fmt_lr, fmt_number

from .autopilot import AutopilotScreen, AutopilotWatcher
from .bridge import EventBridge, LogForwarder
from .checkpoints import CheckpointsScreen
from .dashboard import CHART_BUDGET, CHART_BUDGET_ATTACHED, DashboardScreen
from .dialogs import QuitDialog
from .fork import ForkScreen
from .forms import EditForm
from .help import HelpScreen
from .inspect import InspectScreen
from .messages import CommandFinished, LogRecordArrived, RunReplaced, SessionEventsArrived

__all__ = ["DashboardApp", "OUTCOMES"]

# How often the app shows the newest snapshot. A run elsewhere costs a socket round trip and
# a repaint of the progress line per poll (benchmarks/attach_scale.py: the repaint is the
# larger share): at 3 Hz its step counter still reads as live and the attached dashboard
# stays under 5% of a core (3.9% measured, against 4.0-4.1% at 4 Hz and once 5.2% there).
POLL_LOCAL = 0.25
POLL_ATTACHED = 1 / 3

# What the app returns from run(); the CLI turns each into an exit code (workbench/core/exit_codes.py).
OUTCOMES = (
    "finished",     # the run ended on its own (or had ended when the user quit)
    "saved",        # quit dialog: stop and save (q then Enter)
    "stopped",      # quit dialog: stop without saving
    "interrupted",  # ctrl+c: stop and save, then exit
    "aborted",      # a second ctrl+c: exit without waiting for the save
    "terminated",   # SIGTERM: stop and save, then exit
    "hangup",       # SIGHUP (the CLI stopped the run with a checkpoint): exit
    "failed",
    "crashed",      # the dashboard itself failed; a local run was stopped and saved, a remote one goes on
    "detached",     # an attached dashboard left; the run goes on where it runs
)


# A run stopped by these signals ends the dashboard with the outcome their exit code goes with.
_SIGNAL_OUTCOMES = {"SIGTERM": "terminated", "SIGHUP": "hangup"}
# The stop reason of the dashboard's own stops: its quit dialog, or a signal it was sent.
_STOP_REASONS = {"interrupted": "SIGINT", "terminated": "SIGTERM"}
# The keys that steer the run (the app's actions they call): workbench watch hides them.
_STEERING = frozenset({"toggle_pause", "save", "evaluate", "inspect", "edit", "fork"})


class DashboardApp(App[str]):
    """Show and steer ``session``; ``run()`` returns an outcome from ``OUTCOMES``.

    Options: ``autostart`` starts an idle session on mount; ``frozen`` hides everything that
    depends on wall-clock time or the process (elapsed, speeds, ETA, host memory, ages are
    taken at the snapshot's own time) so screenshots are reproducible; ``handle_signals``
    turns SIGTERM into stop-and-save (the CLI sets it; it needs the main thread).
    """

    CSS_PATH = "app.tcss"
    TITLE = "workbench"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("ctrl+c", "interrupt", "stop+save+exit", show=False, priority=True),
        Binding("ctrl+q", "request_quit", "quit", show=False, priority=True),
    ]

    def __init__(self, session: SessionLike, *, autostart: bool = True, poll_interval: float | None = None,
                 frozen: bool = False, clock: Callable[[], float] = time.time,
                 handle_signals: bool = False, attached: bool = False, read_only: bool = False,
                 autopilot: Any = None) -> None:
        super().__init__()
        # An Autopilot (workbench.autopilot) steering this run from this process: its decisions
        # are logged, o shows its proposals to accept or reject (and the run's, from anyone).
        self.autopilot = autopilot
        self._autopilot_view = AutopilotWatcher(autopilot)
        self.attached = attached  # the run lives elsewhere: leaving detaches, stopping is a choice
        # workbench watch: nothing steers, so no steering key is offered (check_action) and q leaves
        self.read_only = read_only
        self.session = session
        self.autostart = autostart
        if poll_interval is None:
            poll_interval = POLL_ATTACHED if attached else POLL_LOCAL
        self.poll_interval = poll_interval
        self.frozen = frozen
        self.clock = clock
        self.handle_signals = handle_signals
        self.dashboard = DashboardScreen(CHART_BUDGET_ATTACHED if attached else CHART_BUDGET)
        self._generation = 0
        self._bridge = EventBridge(self, session, self._generation)
        self._logs = LogForwarder(self)
        self._snapshot: Snapshot | None = None
        self._quitting: str | None = None  # the outcome to exit with once the run has stopped
        self._exiting = False
        self._poll_error: str | None = None  # the last poll's failure, said once
        self._successor_told: SessionLike | None = None  # the successor the poll has asked to follow

    # -- lifecycle -----------------------------------------------------------------------------

    def get_default_screen(self) -> DashboardScreen:
        return self.dashboard

    def on_mount(self) -> None:
        self._logs.install()
        self._bridge.start()
        if self.autostart and self.session.status == Status.IDLE:
            self.session.start()
        self.set_interval(self.poll_interval, self.poll)
        self.call_after_refresh(self.poll)
        if self.read_only:
            self.log_line("info", "read-only (workbench watch): steer the run with workbench attach or workbench ctl")
        if self.handle_signals:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)

    def on_unmount(self) -> None:
        if self.handle_signals:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        self._bridge.close()
        self._logs.uninstall()

    def now(self) -> float:
        """The time ages are measured against (the snapshot's own time when frozen)."""
        if self.frozen:
            snap = self._snapshot or self.session.snapshot()
            return snap.updated
        return self.clock()

    def poll(self) -> None:
        """Show the newest snapshot (a cheap identity check when nothing changed). A reply the
        dashboard cannot use (an error from a run's endpoint, a broken line) is said once in
        the event log and the next poll tries again: a bad reply never ends the dashboard."""
        try:
            self._poll()
        except Exception as exc:  # noqa: BLE001 - shown, never fatal
            text = f"the run's reply could not be shown: {type(exc).__name__}: {exc}"
            if text != self._poll_error:
                self._poll_error = text
                self.log_line("error", text)
        else:
            self._poll_error = None

    def _poll(self) -> None:
        snap = self.session.snapshot()
        if snap is not self._snapshot:
            self.title = snap.run_name or "workbench"
            if self.dashboard.show(snap, self.frozen):
                self._snapshot = snap
            screen = self.screen
            if screen is not self.dashboard and isinstance(screen, CheckpointsScreen):
                screen.show(snap, self.frozen)
            elif isinstance(screen, ForkScreen):
                screen.show(snap.fork)
            elif isinstance(screen, QuitDialog):  # the step it names is the step a stop chosen now takes
                screen.set_step(snap.step)
        self._autopilot_view.poll(self, snap)
        # The snapshot's status, not session.status: for a run in another process each of
        # those is a round trip, and this runs several times a second.
        ended = snap.status in TERMINAL
        if ended and self._quitting is None and self.session.stop_reason in _SIGNAL_OUTCOMES:
            # Preempted through another rank, or stopped on a hang-up: leave as the scheduler expects.
            self._quitting = _SIGNAL_OUTCOMES[self.session.stop_reason]
        successor = self.session.successor if ended else None
        if successor is not None and successor is not self._successor_told:
            # A branch took the run's process over (a remote `checkpoints branch`): follow it
            # as a branch made here is followed.
            self._successor_told = successor
            note = f"a branch took over this run: {successor.arguments()['output_dir']}"
            self.post_message(RunReplaced(successor, note, branch=True))
            return
        if self._quitting is not None and ended and not self._exiting:
            self._exiting = True  # exit() once; later polls may still run while the app closes
            self.exit(self.outcome())

    def outcome(self) -> str:
        """How the app ends, given the run's status and what the user asked for."""
        if self.session.status == Status.FAILED:
            return "failed"
        return self._quitting or "finished"

    # -- messages from threads ------------------------------------------------------------------

    def on_session_events_arrived(self, message: SessionEventsArrived) -> None:
        if message.generation != self._generation:
            return  # from a session the dashboard no longer follows
        for event in message.events:
            self.dashboard.log_event(event.kind, event.step, event.data)
            if event.kind == "failed":
                self.notify(str(event.data.get("error", "training failed")), title="run failed", severity="error")

    def on_log_record_arrived(self, message: LogRecordArrived) -> None:
        self.log_line(message.level, message.text)

    def on_command_finished(self, message: CommandFinished) -> None:
        if message.error is not None:
            text = f"{message.what} failed: {message.error}"
            self.log_line("error", text)
            self.notify(text, severity="error")
        elif message.what.startswith("save variant ") and isinstance(message.result, str):
            text = f"fork: variant {message.what.removeprefix('save variant ')} saved to {message.result}"
            self.log_line("info", text)
            self.notify(text, timeout=6)
        elif message.what == "evaluate" and isinstance(message.result, dict):
            loss = message.result.get("eval_loss")
            if loss is not None:
                self.notify(f"eval_loss {fmt_number(loss)}", timeout=3)

    def on_run_replaced(self, message: RunReplaced) -> None:
        if message.branch and message.session is self.session:
            self.log_line("info", message.note)  # the other notice of a branch already followed
            return
        self.follow(message.session)
        self.log_line("info", message.note)
        if message.session.status == Status.IDLE:
            message.session.start()

    def log_line(self, level: str, text: str) -> None:
        """Add a line to the dashboard's event log."""
        self.dashboard.log_line(level, text)

    # -- commands -------------------------------------------------------------------------------

    def run_command(self, what: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in a thread (it may block: a save while paused, waiting for a stop) and
        report the result with a CommandFinished message; a returned Future is waited for."""
        def work() -> None:
            try:
                result = fn()
                if isinstance(result, Future):
                    result = result.result()
            except BaseException as exc:  # noqa: BLE001 - reported in the UI
                self.post_message(CommandFinished(what, error=exc))
            else:
                self.post_message(CommandFinished(what, result))

        threading.Thread(target=work, name=f"workbench-tui-{what}", daemon=True).start()

    def _ended(self, what: str) -> bool:
        status = self.session.status
        if status in TERMINAL or status == Status.IDLE:
            self.notify(f"cannot {what}: the run is {status}", severity="warning")
            return True
        return False

    def action_toggle_pause(self) -> None:
        """Pause at the next step boundary, or resume a paused run."""
        status = self.session.status
        if status in (Status.PAUSED, Status.PAUSING):
            self.session.resume()
        elif not self._ended("pause") and status != Status.STOPPING:
            self.session.pause()
        self.poll()

    def action_save(self) -> None:
        """Save a checkpoint now (at the next step end while running)."""
        if not self._ended("save"):
            self.run_command("save", self.session.save)

    def action_evaluate(self) -> None:
        """Evaluate now (at the next step end while running; at once when paused or ended)."""
        if self.session.status == Status.IDLE:
            self.notify("cannot evaluate: the run has not started", severity="warning")
            return
        self.run_command("evaluate", self.session.evaluate)

    def action_checkpoints(self) -> None:
        """Open the checkpoint catalog."""
        self.push_screen(CheckpointsScreen())

    def action_inspect(self) -> None:
        """Open the inspect screen (it pauses a running run first)."""
        if self.session.status == Status.IDLE:
            self.notify("nothing to inspect yet", severity="warning")
            return
        self.push_screen(InspectScreen(frozen=self.frozen))

    def action_edit(self) -> None:
        """Open the hyperparameter form."""
        if self._ended("edit"):
            return

        def done(result: tuple[dict, Any] | None) -> None:
            if result is None:
                return
            changes, applied = result
            if isinstance(applied, Future):  # lands at the next step end; report a late refusal
                shown = " ".join(f"{k}={fmt_lr(v) if k == 'learning_rate' else edit_text(k, v)}"
                                 for k, v in changes.items())
                self.log_line("info", f"edit queued: {shown}")
                self.run_command("edit", lambda: applied)

        self.push_screen(EditForm(self.session, self.session.snapshot()), done)

    def action_fork(self) -> None:
        """Open the fork screen: A/B variants from the pause, then keep one or discard."""
        if not self._ended("fork") and not isinstance(self.screen, ForkScreen):
            self.push_screen(ForkScreen())

    def action_autopilot(self) -> None:
        """Open the proposals: the run's (from any client) and an in-process autopilot's decisions."""
        if self.check_action("autopilot", ()) and not isinstance(self.screen, AutopilotScreen):
            self.push_screen(AutopilotScreen(self.autopilot))

    def action_help(self) -> None:
        """Show the key reference (a watched run's lists no steering key)."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(read_only=self.read_only))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A read-only dashboard (``workbench watch``) neither offers nor runs the steering keys."""
        if self.read_only and action in _STEERING:
            return False
        if action == "autopilot":  # the o key: with an autopilot here, or once the run has had a proposal
            return self.autopilot is not None or self._autopilot_view.has_proposals
        return True

    def action_request_quit(self) -> None:
        """Quit at once when the run has ended (or is only watched); otherwise ask how to stop it."""
        status = self.session.status
        if self.read_only:
            self.exit("detached" if status not in TERMINAL else self.outcome())
            return
        if status in TERMINAL or status == Status.IDLE:
            self.exit(self.outcome())
            return
        if self._quitting is not None:
            self.notify("stopping… (ctrl+c twice exits at once)", timeout=3)
            return

        def chosen(choice: str | None) -> None:
            if choice == "detach":
                self.exit("detached")
            elif choice == "save":
                self._stop_and_exit("saved", save=True)
            elif choice == "discard":
                self._stop_and_exit("stopped", save=False)

        if not isinstance(self.screen, QuitDialog):
            self.push_screen(QuitDialog(self.session.snapshot().step, attached=self.attached), chosen)

    def _stop_and_exit(self, outcome: str, save: bool) -> None:
        self._quitting = outcome
        # Who stopped it, for the end record and every front-end's words (door/endings.py).
        self.session.stop(save=save, reason=_STOP_REASONS.get(outcome, "dashboard"))
        self.log_line("warn", "stopping and saving…" if save else "stopping without saving…")
        self.poll()

    def action_interrupt(self) -> None:
        """ctrl+c: stop and save, then exit (130); a second ctrl+c exits at once."""
        if self.attached:  # ctrl+c in an attached dashboard leaves it; the run is not this process's
            self.exit("detached")
        elif self._quitting is not None:
            self.exit("aborted")
        elif self.session.status in TERMINAL or self.session.status == Status.IDLE:
            self.exit(self.outcome())
        else:
            self._stop_and_exit("interrupted", save=True)

    def _on_sigterm(self) -> None:
        if self._quitting is None and self.session.status not in TERMINAL:
            self._stop_and_exit("terminated", save=True)
        elif self.session.status in TERMINAL:
            self._quitting = "terminated"
            self.poll()

    # -- switching runs ----------------------------------------------------------------------------

    def follow(self, session: SessionLike) -> None:
        """Make the dashboard show and steer ``session`` (its events from the first one)."""
        if session is not self.session:
            self._bridge.close()
            self._generation += 1
            self.session = session
            self._bridge = EventBridge(self, session, self._generation)
            self._bridge.start()
        self._snapshot = None
        self.dashboard.reset()
        while len(self.screen_stack) > 1:
            self.pop_screen()
        self.poll()

    def resume_from(self, checkpoint: CheckpointRow) -> None:
        """Resume the run from ``checkpoint`` (a live run is stopped first, without saving, by
        the session itself: a remote run restarts in its own process)."""
        session = self.session
        self.log_line("warn", f"stopping to resume from {checkpoint.name}…")

        def work() -> Any:
            session.resume_from(checkpoint.path)
            self.post_message(RunReplaced(session, f"resumed from {checkpoint.name}"))

        self.run_command("resume", work)

    def branch_from(self, checkpoint: CheckpointRow, output_dir: str, overrides: dict[str, Any]) -> None:
        """Follow a new run branched from ``checkpoint`` (a live run is stopped first, without
        saving, by the session itself)."""
        session = self.session
        shown = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "no overrides"
        self.log_line("warn", f"stopping to branch from {checkpoint.name} ({shown})…")

        def work() -> Any:
            branch = session.branch(checkpoint.path, output_dir, save=False, **overrides)
            self.post_message(RunReplaced(branch, f"branched from {checkpoint.name} into {Path(output_dir).name}",
                                          branch=True))

        self.run_command("branch", work)

