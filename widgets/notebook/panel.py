"""The Jupyter panel: a thin ipywidgets view over a workbench session (``SessionLike``).

Training runs in the Session's own thread, so the kernel stays free while this panel
updates. A small observer thread polls ``session.snapshot()`` and ``session.events_since()``
at most 4 times a second and copies what changed into widget traits under ``hold_sync()``
(one comm message per widget per refresh). Buttons call the session's commands with what
the user typed; the session checks it and the panel shows its one-line refusal, so the
panel, the dashboard and a script refuse the same inputs. Nothing here touches the trainer,
the model or the loop. Futures that commands return complete in the training thread; their
callbacks only post a notice, which the observer shows, so no widget is written from there.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ipywidgets as w

from workbench.door.protocol import SessionLike, Status
from workbench.door.values import is_timing_metric
from workbench.widgets.view import GUARD_COLORS, SampleBook, fmt_lr, fmt_number

from .autopilot import AutopilotTab
from .charts import LiveChart, Trace
from .steer import ForkTab, ScheduleTab
from .tables import (
    checkpoints_html,
    error_html,
    evaluations_html,
    event_entry,
    events_html,
    interventions_html,
    memory_html,
    metrics_html,
    notice_html,
    samples_html,
    status_html,
    terminal,
)

__all__ = ["Panel", "MIN_INTERVAL"]

MIN_INTERVAL = 0.25  # seconds: the observer refreshes at most 4 times a second
_PAUSING_NOTICE = "pausing at the next step boundary"  # replaced by "paused at step N" once it lands
# A run that can still be paused, saved and stopped (alive, and not already stopping).
_ACTIVE = (Status.RUNNING, Status.PAUSING, Status.PAUSED, Status.EVALUATING, Status.SAVING)


def _button(description: str, icon: str, tooltip: str, style: str = "") -> w.Button:
    return w.Button(description=description, icon=icon, tooltip=tooltip, button_style=style,
                    layout=w.Layout(width="auto", min_width="92px"))


class Panel(w.VBox):
    """Status, controls, live charts and tables for one Session.

    Layout, top to bottom: status line; progress bar; a row of Pause/Resume, Save,
    Evaluate, Stop and the learning-rate field with Apply; a notice line answering the last
    button press; the error area (hidden until the run fails); two charts side by side
    (train/eval loss; learning rate and grad norm); tabs Metrics, Memory, Checkpoints
    (resume from, delete, branch), Events, Samples (each prompt of the run's ``[samples]``,
    then its answers newest first), Guard (the guard's interventions, also marked on the
    loss chart), Schedule, Fork, Autopilot (the changes proposed to the run, from any client, to
    accept or reject; with ``autopilot``, an Autopilot steering the run from this kernel, its
    decisions too); and below, the panels of runs branched from here.
    """

    def __init__(self, session: SessionLike, interval: float = MIN_INTERVAL, autostart: bool = True,
                 autopilot: Any = None) -> None:
        """Build the widgets and start the observer (``autostart=False`` leaves refreshes to the caller)."""
        if not isinstance(interval, (int, float)) or not math.isfinite(interval) or interval < MIN_INTERVAL:
            raise ValueError(f"interval: at least {MIN_INTERVAL} s (the panel refreshes at most 4 times a second)")
        self.session = session
        self.interval = float(interval)
        self.branches: list[SessionLike] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cursor = 0  # events_since() cursor: from the run's first event, so a late panel shows them
        self._log: deque[tuple[float, str, str]] = deque(maxlen=12)
        self._notice: tuple[str, str] = ("info", "")
        self._posted: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._last: Any = None
        self._cache: dict[str, Any] = {}
        self._error_text: str | None = None
        self._closed = False
        self.refresh_count = 0
        self.refresh_seconds = 0.0
        self.refresh_max = 0.0
        self.observer_error: BaseException | None = None

        # -- header and controls --------------------------------------------------------------
        self.status = w.HTML()
        self.progress = w.IntProgress(min=0, max=1, value=0, layout=w.Layout(width="100%", height="14px"))
        self.pause_button = _button("Pause", "pause", "Pause at the next step boundary (resume continues exactly)")
        self.save_button = _button("Save", "save", "Save a checkpoint now (at the next step end while running)")
        self.evaluate_button = _button("Evaluate", "check", "Evaluate now (at the next step end while running)")
        self.stop_button = _button("Stop", "stop", "Stop at the next safe point after saving a checkpoint", "danger")
        self.lr_field = w.Text(placeholder="learning rate, e.g. 1e-4", continuous_update=False,
                               layout=w.Layout(width="190px"))
        self.lr_apply = _button("Apply", "", "Set the base learning rate the schedule scales from")
        self.notice = w.HTML()
        self.error = w.HTML(layout=w.Layout(display="none"))
        controls = w.HBox([self.pause_button, self.save_button, self.evaluate_button, self.stop_button,
                           w.HTML("&nbsp;", layout=w.Layout(flex="1 1 auto")), self.lr_field, self.lr_apply],
                          layout=w.Layout(width="100%", align_items="center", flex_flow="row wrap"))

        # -- charts -------------------------------------------------------------------------------
        self.loss_chart = LiveChart("Loss", [Trace("loss", "train loss", "#1f77b4"),
                                             Trace("eval_loss", "eval loss", "#ff7f0e", marker="circle")],
                                    left_label="loss")
        self.lr_chart = LiveChart("Learning rate / grad norm",
                                  [Trace("learning_rate", "learning rate", "#2ca02c"),
                                   Trace("lr_plan", "planned", "#2ca02c", dashed=True),
                                   Trace("lr_preview", "after the change", "#ff7f0e", dashed=True),
                                   Trace("grad_norm", "grad norm", "#9467bd", axis="right")],
                                  left_label="learning rate", right_label="grad norm",
                                  tick_format={"left": ".1e"})
        charts = w.HBox([self.loss_chart.figure, self.lr_chart.figure],
                        layout=w.Layout(width="100%", flex_flow="row wrap"))

        # -- tabs: metrics, memory, checkpoints, events ------------------------------------------------
        self.metrics = w.HTML()
        self.evaluations = w.HTML()
        self.memory = w.HTML()
        self.checkpoints = w.HTML()
        self.checkpoint_select = w.Dropdown(options=[], description="checkpoint",
                                            layout=w.Layout(width="260px"))
        self.resume_button = _button("Resume from", "play", "Restart this run from the selected checkpoint "
                                     "(stop the current run first)")
        self.delete_button = _button("Delete", "trash", "Delete the selected checkpoint (the best, the newest and "
                                     "the one this run resumes from are kept)")
        self.branch_dir = w.Text(placeholder="branch output_dir (default: <output_dir>-branch-<step>)",
                                 layout=w.Layout(width="330px"))
        self.branch_lr = w.Text(placeholder="learning rate (optional)", layout=w.Layout(width="170px"))
        self.branch_button = _button("Branch", "code-fork", "Start a new run from the selected checkpoint into "
                                     "another output_dir, with a different learning rate if given")
        self.events = w.HTML()
        self.guard = w.HTML(interventions_html((), GUARD_COLORS))
        self.sample_book = SampleBook()  # the run's answers to its prompts, from its sampled events
        self._samples_drawn = -1  # the book's count when the Samples tab was drawn
        self.samples = w.HTML()
        browser = w.VBox([self.checkpoints,
                          w.HBox([self.checkpoint_select, self.resume_button, self.delete_button],
                                 layout=w.Layout(flex_flow="row wrap", align_items="center")),
                          w.HBox([self.branch_dir, self.branch_lr, self.branch_button],
                                 layout=w.Layout(flex_flow="row wrap", align_items="center"))])
        self.schedule = ScheduleTab(self)  # issue 28: changes of the schedule's shape, previewed
        self.forks = ForkTab(self)  # issue 28: A/B forks from the pause
        # issue 28: the run's proposals (accept, reject), and an in-kernel autopilot's decisions
        self.autopilot = AutopilotTab(self, autopilot)
        self.tabs = w.Tab(children=[w.VBox([self.metrics, self.evaluations]), self.memory, browser, self.events,
                                    self.samples, self.guard, self.schedule.box, self.forks.box, self.autopilot.box])
        self.tabs.titles = self._tab_titles(())
        self.branch_box = w.VBox()

        self._text_widgets = [self.status, self.progress, self.pause_button, self.save_button, self.evaluate_button,
                              self.stop_button, self.lr_field, self.notice, self.error, self.metrics,
                              self.evaluations, self.memory, self.checkpoints, self.checkpoint_select,
                              self.resume_button, self.delete_button, self.branch_button, self.events, self.guard,
                              self.samples, self.tabs]
        self._owned: list[w.Widget] = [*self._text_widgets, self.lr_apply, self.branch_dir, self.branch_lr,
                                       controls, charts, browser, self.branch_box,
                                       *browser.children[1:], *controls.children[4:5], *self.schedule.widgets,
                                       *self.forks.widgets, *self.autopilot.widgets]
        self.pause_button.on_click(self._guard(self._on_pause))
        self.save_button.on_click(self._guard(self._on_save))
        self.evaluate_button.on_click(self._guard(self._on_evaluate))
        self.stop_button.on_click(self._guard(self._on_stop))
        self.lr_apply.on_click(self._guard(self._on_apply_lr))
        self.resume_button.on_click(self._guard(self._on_resume_from))
        self.delete_button.on_click(self._guard(self._on_delete))
        self.branch_button.on_click(self._guard(self._on_branch))

        super().__init__([self.status, self.progress, controls, self.notice, self.error, charts, self.tabs,
                          self.branch_box], layout=w.Layout(width="100%"))
        self.add_class("workbench-panel")
        self.refresh()
        if autostart:
            self.start()

    # -- observer ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the observer thread (idempotent; a closed panel cannot restart)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this panel is closed; call session.panel() for a new one")
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._observe, name="workbench-panel", daemon=True)
            self._thread.start()

    @property
    def observing(self) -> bool:
        """Whether the observer thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _observe(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - a drawing bug must not kill the updates
                self.observer_error = exc
                self._set_notice("error", f"panel update failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the observer, stop listening to the session and close every widget of the panel."""
        if not hasattr(self, "_owned"):  # __init__ failed early; Widget.__del__ still calls close()
            super().close()
            return
        with self._lock:
            self._closed = True
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        for child in list(self.branch_box.children):
            child.close()
        self.loss_chart.close()
        self.lr_chart.close()
        self.forks.chart.close()
        for widget in self._owned:
            widget.close()
        super().close()

    @property
    def refresh_stats(self) -> dict[str, float]:
        """How many refreshes ran and their mean and worst cost in milliseconds."""
        count = self.refresh_count
        return {"count": count, "mean_ms": 1000.0 * self.refresh_seconds / count if count else 0.0,
                "max_ms": 1000.0 * self.refresh_max}

    # -- refresh -------------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Copy the newest snapshot (and events, notices) into the widgets; only changes are sent.

        Safe from any thread: refreshes and button handlers are serialized by one lock, and
        each widget's changes go out as one message when its hold_sync() block ends.
        """
        started = time.perf_counter()
        with self._lock:
            if self._closed:
                return
            snap = self.session.snapshot()
            self._adopt_successor()
            log_changed = self._drain_events()
            if snap is self._last and not log_changed and not self.autopilot.stale:
                return
            self._last = snap
            widgets = [*self._text_widgets, *self.loss_chart.widgets, *self.lr_chart.widgets]
            with contextlib.ExitStack() as stack:
                for widget in widgets:
                    stack.enter_context(widget.hold_sync())
                self._apply(snap, log_changed)
            took = time.perf_counter() - started
            self.refresh_count += 1
            self.refresh_seconds += took
            self.refresh_max = max(self.refresh_max, took)

    def _adopt_successor(self) -> None:
        """Show a branch that took this run's process over (a remote ``checkpoints branch``)
        below, as a branch made from this panel is shown."""
        successor = self.session.successor
        if successor is None or any(b is successor for b in self.branches):
            return
        output_dir = successor.arguments()["output_dir"]
        self.branch_box.children = (*self.branch_box.children, Panel(successor, interval=self.interval))
        self.branches.append(successor)
        self._posted.put(("good", f"a branch took over this run: {output_dir} (shown below)"))

    def _drain_events(self) -> bool:
        changed = False
        events, self._cursor = self.session.events_since(self._cursor)
        for event in events:
            if self.sample_book.add(event.kind, event.step, event.data):
                changed = True  # shown in the Samples tab, not the event log
                continue
            entry = event_entry(event)
            if entry is not None:
                self._log.append(entry)
                changed = True
        while True:
            try:
                level, text = self._posted.get_nowait()
            except queue.Empty:
                break
            self._notice = (level, text)
            self._log.append((time.time(), level, text))
            changed = True
        return changed

    def _changed(self, name: str, value: Any) -> bool:
        """Whether ``value`` differs (by identity) from what ``name`` was drawn from last time."""
        if name in self._cache and self._cache[name] is value:
            return False
        self._cache[name] = value
        return True

    def _apply(self, snap: Any, log_changed: bool) -> None:
        status = snap.status
        self.status.value = status_html(snap)
        self.progress.max = max(snap.max_steps, 1)
        self.progress.value = min(snap.step, self.progress.max)
        self.progress.bar_style = {Status.PAUSED: "warning", Status.PAUSING: "warning", Status.FINISHED: "success",
                                   Status.FAILED: "danger", Status.STOPPED: "info"}.get(status, "")
        paused = status in (Status.PAUSED, Status.PAUSING)
        self.pause_button.description = "Resume" if paused else "Pause"
        self.pause_button.icon = "play" if paused else "pause"
        self.pause_button.disabled = status not in _ACTIVE
        self.save_button.disabled = status not in _ACTIVE
        self.stop_button.disabled = status not in _ACTIVE
        self.evaluate_button.disabled = status in (Status.IDLE, Status.STOPPING)
        lr = snap.latest("learning_rate")
        self.lr_field.placeholder = (f"learning rate (now {fmt_lr(lr)})" if lr is not None
                                     else "learning rate, e.g. 1e-4")
        self.lr_field.disabled = terminal(status)
        if status == Status.PAUSED and self._notice[1] == _PAUSING_NOTICE:
            self._notice = ("info", f"paused at step {snap.step}")
        self.notice.value = notice_html(*self._notice)
        if snap.error != self._error_text:
            self._error_text = snap.error
            self.error.value = error_html(snap.error, snap.traceback)
            self.error.layout.display = "" if snap.error else "none"

        series = snap.series
        self.loss_chart.update(series, snap.max_steps)
        self.forks.show(getattr(snap, "fork", None))  # a fork made here, in a script or by a remote client
        # The plan for the rest of the run and a previewed change, dashed after the logged rate.
        self.lr_chart.update({**series, "lr_plan": getattr(snap, "lr_plan", ()), "lr_preview": self.schedule.preview},
                             max([snap.max_steps, *(p[0] for p in self.schedule.preview[-1:])]))
        if self._changed("series", series) | self._changed("best", (snap.best_metric, snap.best_step)):
            self.metrics.value = metrics_html(series, snap.best_metric, snap.best_step)
            self.evaluations.value = evaluations_html(series, snap.best_step)
        if self._changed("memory", snap.memory):
            self.memory.value = memory_html(snap.memory)
        if self._changed("checkpoints", snap.checkpoints) or int(time.time()) != self._cache.get("clock"):
            self._cache["clock"] = int(time.time())  # ages ("12s ago") tick once a second
            self.checkpoints.value = checkpoints_html(snap.checkpoints)
            self._update_checkpoint_options(snap.checkpoints)
        can_restart = status == Status.IDLE or terminal(status)
        self.resume_button.disabled = not can_restart or self.checkpoint_select.value is None
        self.delete_button.disabled = self.checkpoint_select.value is None
        self.branch_button.disabled = not can_restart or self.checkpoint_select.value is None
        if log_changed:
            self.events.value = events_html(list(self._log))
        interventions = getattr(snap, "interventions", ())
        if self.sample_book.count != self._samples_drawn:
            self._samples_drawn = self.sample_book.count
            self.samples.value = samples_html(self.sample_book)
        if self._changed("interventions", interventions):
            self.loss_chart.set_marks([(i.step, GUARD_COLORS.get(i.kind, "#888888")) for i in interventions])
            self.guard.value = interventions_html(interventions, GUARD_COLORS)
        self.autopilot.show(getattr(snap, "proposals", ()))
        titles = self._tab_titles(interventions)
        if tuple(self.tabs.titles) != titles:
            self.tabs.titles = titles

    def _tab_titles(self, interventions: Any) -> tuple[str, ...]:
        """The tabs' titles: the Samples and Guard tabs count what they list."""
        prompts = len(self.sample_book.prompts())
        titles = ("Metrics", "Memory", "Checkpoints", "Events", f"Samples ({prompts})" if prompts else "Samples",
                  f"Guard ({len(interventions)})" if interventions else "Guard", "Schedule", "Fork")
        pending = self.autopilot.pending  # proposals waiting for an answer
        return (*titles, f"Autopilot ({pending})" if pending else "Autopilot")

    def _update_checkpoint_options(self, checkpoints: Any) -> None:
        options = tuple((f"{c.name}{' ★' if c.best else ''}", c.path) for c in checkpoints if c.complete)
        if options == self._cache.get("options"):
            return
        self._cache["options"] = options
        keep = self.checkpoint_select.value
        self.checkpoint_select.options = options
        values = [value for _, value in options]
        if keep in values:
            self.checkpoint_select.value = keep
        elif values:
            self.checkpoint_select.value = values[-1]  # the newest is the usual choice

    # -- commands ---------------------------------------------------------------------------------------------

    def _guard(self, handler: Callable[[], None]) -> Callable[[w.Button], None]:
        """Run a button handler; show its outcome or error in the notice line, then refresh."""
        def on_click(_button: w.Button) -> None:
            try:
                with self._lock:
                    handler()
            except (ValueError, RuntimeError, OSError) as exc:
                self._set_notice("error", str(exc))
            except Exception as exc:  # noqa: BLE001 - a notebook callback must never raise into the void
                self._set_notice("error", f"{type(exc).__name__}: {exc}")
            self.refresh()
        return on_click

    def _set_notice(self, level: str, text: str) -> None:
        """Queue a notice for the next refresh (callable from any thread, e.g. a Future callback)."""
        self._posted.put((level, text))
        self._last = None  # make the next refresh draw even if the snapshot did not change

    def _follow(self, future: Future, done: Callable[[Any], str], what: str) -> None:
        def report(f: Future) -> None:
            try:
                self._set_notice("good", done(f.result()))
            except Exception as exc:  # noqa: BLE001 - shown, not raised, in the training thread
                self._set_notice("error", f"{what} failed: {exc}")
        future.add_done_callback(report)

    def _on_pause(self) -> None:
        if self.session.status in (Status.PAUSED, Status.PAUSING):
            self.session.resume()
            self._set_notice("info", "resumed")
        else:
            status = self.session.pause()
            self._set_notice("info", _PAUSING_NOTICE if status == Status.PAUSING else status)

    def _on_save(self) -> None:
        result = self.session.save()
        if isinstance(result, Future):
            self._set_notice("info", "saving at the next step end...")
            self._follow(result, lambda path: f"saved {Path(path).name}", "save")
        else:
            self._set_notice("good", f"saved {Path(result).name}")

    def _on_evaluate(self) -> None:
        result = self.session.evaluate()
        describe = lambda m: "evaluated: " + " ".join(  # noqa: E731
            f"{k.removeprefix('eval_')}={fmt_number(v)}" for k, v in m.items()
            if isinstance(v, float) and not is_timing_metric(k))
        if isinstance(result, Future):
            self._set_notice("info", "evaluating at the next step end...")
            self._follow(result, describe, "evaluation")
        else:
            self._set_notice("good", describe(result))

    def _on_stop(self) -> None:
        status = self.session.stop(save=True, reason="notebook")
        self._set_notice("warn", "stopping: a checkpoint is saved at the next safe point"
                         if status == Status.STOPPING else f"nothing to stop: the run is {status}")

    def _on_apply_lr(self) -> None:
        # The session reads and checks the text (the one learning-rate rule); its refusal is the notice.
        value = self.session.validate_edits({"learning_rate": self.lr_field.value})["learning_rate"]
        result = self.session.set(learning_rate=value)
        if isinstance(result, Future):
            self._set_notice("info", f"learning rate {fmt_lr(value)}: applied at the next step end")
            self._follow(result, lambda applied: f"learning rate set to {fmt_lr(applied['learning_rate'])}", "edit")
        else:
            self._set_notice("good", f"learning rate set to {fmt_lr(value)}")
        self.lr_field.value = ""

    def _selected_checkpoint(self) -> str:
        path = self.checkpoint_select.value
        if not path:
            raise ValueError("no checkpoint selected")
        return path

    def _on_delete(self) -> None:
        name = Path(self._selected_checkpoint()).name
        self.session.delete_checkpoint(name)  # the session refuses the protected and the one in use
        self._cache.pop("checkpoints", None)
        self._set_notice("warn", f"deleted {name}")

    def _on_resume_from(self) -> None:
        path = self._selected_checkpoint()
        self.session.resume_from(path)
        self._cache.clear()
        self._set_notice("info", f"resuming from {Path(path).name}")

    def _on_branch(self) -> None:
        path = self._selected_checkpoint()
        # Read and checked by the session (check_branch inside branch()): the same refusals as
        # the dashboard's form and session.branch() in a script.
        overrides = self.session.parse_overrides({"learning_rate": self.branch_lr.value})
        output_dir = self.branch_dir.value.strip()
        if not output_dir:
            base = self.session.snapshot().output_dir
            if not base:
                raise ValueError("branch: type an output_dir for the new run")
            base = str(base).rstrip("/")
            output_dir = f"{base}-branch-{Path(path).name.rsplit('-', 1)[-1]}"
        branch = self.session.branch(path, output_dir, **overrides)  # a live run is stopped (saved) first
        if branch.status == Status.IDLE:  # from an ended local run: not started yet
            branch.start()
        self.branches.append(branch)
        self.branch_box.children = (*self.branch_box.children, Panel(branch, interval=self.interval))
        self._set_notice("good", f"branched from {Path(path).name} into {output_dir}")
