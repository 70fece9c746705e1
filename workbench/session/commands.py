"""The Session's commands and their status: pause, resume, stop, save, evaluate and live
edits, from any thread, checked once here for every front-end.

A command returns at once. While the run trains it goes on a queue that the Session's
steering gate (``SessionGate`` in local.py; gates: core/run.py) drains at the next step end, turning it into
``TrainerControl`` flags or an applied edit; a pause holds the loop in that gate at the
start of the next step. While the run is paused, saves, evaluations and edits run in the
caller's thread (with several processes, on the worker, which every rank follows), every RNG
stream kept as it was. A mixin of :class:`workbench.session.local.Session`: it uses the
Session's lock, status and publishing (publishing.py).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.core.edits import apply_edit, check_reason, edit_changes, record_edit, validate_edits
from workbench.door.values import ENDED, Status
from workbench.session.rank_pause import hold_ranks_paused

__all__ = ["SessionCommands"]


def _chain(source: Future, target: Future) -> None:
    """Complete ``target`` with ``source``'s outcome."""
    def copy(done: Future) -> None:
        if done.exception() is not None:
            target.set_exception(done.exception())
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


@dataclass(frozen=True)
class _Command:
    kind: str  # "save" | "evaluate" | "set"
    future: Future = field(default_factory=Future, compare=False)
    changes: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None  # set: why (kept with the edit's record and event)


class SessionCommands:
    """The commands of a Session (mixed into it)."""

    # -- commands ----------------------------------------------------------------------

    def pause(self, wait: bool = False, timeout: float | None = None) -> Status:
        """Pause at the next step boundary ("pausing" until then; wait=True blocks until "paused")."""
        self._require_main("pause")
        with self._lock:
            if self._status in ENDED or self._status in (Status.IDLE, Status.STOPPING):
                return self._status
            self._pause_requested.set()
            if self._blocked:
                # Paused again before the worker woke from the last pause: it never left
                # the step boundary, so the run is paused now (not "pausing" forever).
                if self._status != Status.PAUSED:
                    self._set_status(Status.PAUSED)
                    self._emit("paused")
                    self._log_event("pause")
            elif self._status != Status.PAUSED:
                self._set_status(Status.PAUSING)
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._status != Status.PAUSED and self._status not in ENDED:
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.005)
        return self._status

    def resume(self) -> Status:
        """Continue a paused run with exactly the state it had (a fork not kept is discarded)."""
        self.discard()
        with self._lock:
            self._pause_requested.clear()
            if self._status in (Status.PAUSED, Status.PAUSING):
                self._set_status(Status.RUNNING)
                self._emit("resumed")
                self._log_event("resume")
            self._unpaused.notify_all()
        return self._status

    def stop(self, save: bool = True, reason: str | None = "session") -> Status:
        """Stop at the next safe point (step end or evaluation batch), saving a checkpoint first.

        ``reason``: who asks, for the end record, the exit code and the words every front-end
        uses (door/endings.py): "session" from Python, "dashboard", "notebook", a control
        client's name ("ctl", "attach"), "SIGINT", "SIGHUP" from the CLI when the terminal closed."""
        reason = reason or "session"
        with self._lock:
            if self._status in ENDED or self._status == Status.IDLE:
                return self._status
            self.trainer.stop_request.set(reason, save=save)
            self._set_status(Status.STOPPING)
            self._pause_requested.clear()
            self._unpaused.notify_all()
        return self._status

    def save(self) -> Future | Path:
        """Save a checkpoint: at once when paused (returns its path), else at the next step end (a Future)."""
        self._require_main("save")
        with self._lock:
            if self._status == Status.PAUSED:
                if self._sync is None:
                    return self._save_now()
                future = self._queue_paused_action("save")
            elif self._status in ENDED or self._status == Status.IDLE:
                raise RuntimeError(f"cannot save: the session is {self._status}")
            else:
                command = _Command("save")
                self._commands.put(command)
                return command.future
        return future.result()

    def evaluate(self) -> Future | dict[str, float]:
        """Evaluate: in this thread when paused (returns metrics), else at the next step end (a Future)."""
        self._require_main("evaluate")
        with self._lock:
            if self._status == Status.PAUSED and self._sync is not None:
                future = self._queue_paused_action("evaluate")
            elif self._status in (Status.PAUSED, Status.IDLE) or self._status in ENDED:
                return self._evaluate_now()
            else:
                command = _Command("evaluate")
                self._commands.put(command)
                return command.future
        return future.result()

    def validate_edits(self, changes: Mapping[str, Any], reason: str | None = None) -> dict[str, Any]:
        """The check ``set()`` makes, without applying anything: each value (numbers, or text
        as typed into a form) parsed and checked by the one rule per key
        (workbench.core.edits), the learning rate set or scaled but not both, max_steps not
        below the current step. Returns the parsed edits; raises ValueError with one line.

        Front-ends call it to refuse a typo while their form is still open. ``reason``, when
        given, is checked too (text, at most MAX_REASON characters)."""
        check_reason(reason)
        return validate_edits(changes, self.trainer.state.global_step)

    def lr_plan(self, schedule: Mapping[str, Any] | str | None = None) -> tuple[tuple[int, float], ...]:
        """The learning rate planned for the rest of the run, ``(step, rate)`` pairs; with
        ``schedule`` (a change as ``set(schedule=...)`` takes it) what it would be after that
        change, applying nothing: the preview a front-end draws before the edit."""
        from workbench.core.schedule_edits import planned_rates

        return planned_rates(self.trainer, schedule)

    def set(self, reason: str | None = None, **changes: Any) -> Future | dict[str, Any]:
        """Change hyperparameters live: learning_rate, lr_scale, max_steps, num_train_epochs,
        logging_steps, eval_steps, save_steps, schedule (a change of the schedule's shape:
        decay_now, extend, rewarm, scale_peak; see core/schedule_edits.py). Applied at once when paused, else at the next
        step end (a Future). Invalid names or values raise ValueError here, before queuing
        (see validate_edits). ``reason`` (one line) says why: it is stored in the live-edit
        record and the ``edit`` event, so an agent's decisions can be audited later."""
        changes = self.validate_edits(changes, reason)
        reason = check_reason(reason)
        self._require_main("set")
        with self._lock:
            if self._sync is not None and self._status == Status.IDLE:
                raise RuntimeError("set: with several processes, edit a run once it has started "
                                   "(or change the config)")
            if self._status in (Status.PAUSED, Status.IDLE):
                applied = self._apply_edits(changes, reason)
                if self._sync is not None:  # the other ranks apply it at the next heartbeat
                    self._sync.publish_record(self.trainer.workbench_state.live_edits[-1])
                return applied
            if self._status in ENDED:
                raise RuntimeError(f"cannot edit: the session is {self._status}")
            command = _Command("set", changes=dict(changes), reason=reason)
            self._commands.put(command)
            return command.future

    def _require_main(self, what: str) -> None:
        if self._sync is not None and not self._sync.is_main:
            raise RuntimeError(f"{what}: with several processes the run is steered from rank 0 "
                               "(call it where trainer.is_world_process_zero() is True)")

    def _queue_paused_action(self, kind: str, order: dict[str, Any] | None = None) -> Future:
        """An action every rank runs at the paused ranks' next heartbeat (rank_pause.py):
        save, evaluate, or a fork's fork / keep / discard with its ``order``."""
        future: Future = Future()
        self._paused_actions.put((kind, future, order))
        self._unpaused.notify_all()
        return future

    def _require_single(self, what: str) -> None:
        if self._sync is not None:
            raise RuntimeError(f"{what}: not available with several processes; relaunch the run with --resume "
                               "CHECKPOINT (and --set for changed arguments)")

    def _require_not_running(self, what: str) -> None:
        self._require_single(what)
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{what}: stop the current run first (session.stop(); session.wait())")

    # -- in the loop (the steering gate) and between steps (a paused run) ------------------------

    def _maybe_block(self) -> None:
        if self._sync is not None:
            if self._sync.is_main and self._sync.paused:
                hold_ranks_paused(self, self._sync)
            return
        if not self._pause_requested.is_set():
            return
        with self._lock:
            if not self._pause_requested.is_set():
                return
            self._set_status(Status.PAUSED)
            self._emit("paused")
            self._log_event("pause")
            # Time spent paused is not training time: the clock of elapsed, rates and ETA stops.
            self._pause_clock.begin()
            self._blocked = True
            try:
                while self._pause_requested.is_set() and not self.trainer.stop_request.is_set():
                    self._unpaused.wait(0.5)
                    # A paused run publishes nothing else: this keeps its paused time counting
                    # on every front-end (the elapsed clock stands still).
                    self._publish_locked()
            finally:
                self._blocked = False
                self._pause_clock.end()
            if self._status == Status.PAUSED:
                self._set_status(Status.RUNNING)

    def _requeue(self, kind: str, future: Future) -> None:
        """A save or evaluation asked for just as a pause ended: run it at the next step."""
        self._commands.put(_Command(kind, future=future))

    def _drain(self, control) -> None:
        if self._commands.empty():  # the common case, without raising queue.Empty every step
            return
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command.kind == "set":
                if self._sync is not None:  # every rank applies it at the next agreement
                    # The reason rides along with the changes; _apply_edit_record takes it off.
                    proposal = {**command.changes, **({"reason": command.reason} if command.reason else {})}
                    _chain(self._sync.propose_edit(proposal), command.future)
                    continue
                try:
                    command.future.set_result(self._apply_edits(command.changes, command.reason))
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    command.future.set_exception(exc)
            elif command.kind == "save":
                self._request(control, "save")
                self._pending_saves.append(command.future)
                self._set_status(Status.SAVING, only_from=(Status.RUNNING,))
            elif command.kind == "evaluate":
                self._request(control, "evaluate")
                self._pending_evals.append(command.future)

    def _request(self, control, kind: str) -> None:
        if self._sync is not None:
            self._sync.request(kind)  # all ranks save / evaluate at the next agreement
        elif kind == "save":
            control.should_save = True
        else:
            control.should_evaluate = True

    def _fail_pending(self) -> None:
        for f in [*self._pending_saves, *self._pending_evals]:
            if not f.done():
                f.set_exception(RuntimeError(f"the run ended ({self._status}) before the command ran"))
        self._pending_saves, self._pending_evals = [], []
        while not self._paused_actions.empty():
            self._paused_actions.get_nowait()[1].set_exception(
                RuntimeError(f"the run ended ({self._status}) before the command ran"))
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command.future.set_exception(RuntimeError(f"the run ended ({self._status}) before the command ran"))

    def _save_now(self) -> Path:
        return self.trainer.save_between_steps()

    def _evaluate_now(self) -> dict[str, float]:
        return self.trainer.evaluate_between_steps()

    def _apply_edit_record(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply an edit the ranks agreed on; its live-edit record goes to the other ranks."""
        changes = dict(changes)
        reason = changes.pop("reason", None)
        self._apply_edits(changes, reason)
        return dict(self.trainer.workbench_state.live_edits[-1])

    def _apply_edits(self, changes: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        trainer = self.trainer
        applied = {}
        # The edits that can still be refused (they depend on the current step) go first, so a
        # refused set() changes nothing.
        for key, value in sorted(changes.items(),
                                 key=lambda kv: kv[0] not in ("max_steps", "num_train_epochs", "schedule")):
            applied[key] = apply_edit(trainer, key, value)
        why = {"reason": reason} if reason else {}  # no empty "reason" keys in old-style records
        # Recorded as every edit is (the live edits, events.jsonl, then _on_run_edit below).
        record_edit(trainer, {"step": trainer.state.global_step, "time": time.time(), **applied, **why})
        return applied

    def _on_run_edit(self, record: dict[str, Any]) -> None:
        """A live edit recorded (core/edits.py record_edit: this Session's set(), or one the run
        made itself, such as an out-of-memory recovery's cut, on the training thread): into the
        snapshot's edits and an ``edited`` event, so every front-end shows it."""
        self._edits.append(record)  # (a list's append is atomic: the snapshot reads it under the lock)
        self._emit("edited", **edit_changes(record), **{k: record[k] for k in ("reason", "memory") if k in record})
        self._publish()
