"""Session: train in a background thread, and pause, inspect, edit, save or evaluate it.

The worker thread runs ``trainer.train()``. Commands from any thread go on a queue; the
Session's steering gate (``SessionGate``, core/run.py) drains it at step boundaries and
turns commands into ``TrainerControl`` flags and live edits. Pausing holds the worker in
that gate at the start of the next step; while it is blocked, inspection and evaluation run in the
caller's thread, with every RNG state saved and restored so the resumed run stays bitwise
equal to one never paused. Front-ends read ``snapshot()`` (immutable, swapped atomically)
and ``events_since()``; they never touch the trainer. The methods front-ends use are the
``SessionLike`` protocol (protocol.py); each command is checked here, once, for all of them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workbench.core.exit_codes import run_exit_code
from workbench.core.callbacks import TrainerCallback
from workbench.core.run import Gate
from workbench.session.checkpoint_commands import CheckpointCommands
from workbench.session.events import EventHub
from workbench.session.loop_hold import reading_the_model
from workbench.session.rank_pause import hold_ranks_paused
from workbench.door.values import ENDED, SNAPSHOT_EDITS, SNAPSHOT_INTERVENTIONS, Intervention, MemoryUsage, SeriesStore
from workbench.door.values import SessionEvent, Snapshot, Status
from workbench.core.edits import apply_edit, check_reason, validate_edits
from workbench.core.rng import rng_preserved
from workbench.core.trainer_utils import unwrap_model


__all__ = ["Session", "Snapshot", "SessionEvent", "Status"]

Trainer = Any  # annotations only: Trainer imports this module (directly or not), so it is not imported back


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


class SessionGate(Gate):
    """The Session's hands inside the loop: the steering gate (core/run.py). At a step's
    start a paused run waits here; at its end queued commands become flags and edits."""

    def __init__(self, session: "Session") -> None:
        self.session = session

    def step_start(self, run) -> None:
        self.session._maybe_block()  # the run may wait here (paused); a stop meanwhile: the stop gate acts next

    def step_end(self, run) -> None:
        self.session._drain(run.control)
        self.session._tick(run.state)

    def pause_for_guard(self, run) -> bool:
        session = self.session
        if session._sync is not None or not session.pauses_for_guard:
            return False  # several processes, or headless: the guard stops the run with a checkpoint
        session.pause()
        return True


class SessionObserver(TrainerCallback):
    """What the Session hears of the run, as any HF callback does: it publishes it."""

    def __init__(self, session: "Session") -> None:
        self.session = session

    def on_train_begin(self, args, state, control, **kwargs):
        self.session._on_train_begin(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.session._on_log(state, logs or {})

    def on_prediction_step(self, args, state, control, **kwargs):
        self.session._set_status(Status.EVALUATING, only_from=(Status.RUNNING,))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.session._on_evaluate(state, metrics or {})

    def on_save(self, args, state, control, **kwargs):
        self.session._on_save(state)


class Session(CheckpointCommands):
    """A training run you can watch and steer from notebooks, terminals and scripts."""

    def __init__(self, trainer: "Trainer", resume_from_checkpoint: str | bool | None = None,
                 origin: dict[str, Any] | None = None, guard: Any = None, control: bool | None = None,
                 control_port: int | None = None, control_host: str | None = None,
                 train_kwargs: dict[str, Any] | None = None) -> None:
        self.trainer = trainer
        trainer.control_owner = self  # this Session decides about the endpoint, not args.control
        if guard is not None:  # a Guard given here replaces the trainer's (train/guard.py)
            from workbench.guard.settings import Guard

            if not isinstance(guard, Guard):
                raise TypeError(f"guard: expected a workbench Guard, got {type(guard).__name__}")
            trainer.guard = guard
        # The control endpoint (workbench.control): control=, else args.control when set, else on
        # unless WORKBENCH_CONTROL=0; a Unix socket, or TCP on control_port (loopback unless
        # control_host names another address). Same order for the port and host.
        args = trainer.args
        if control is None:
            control = getattr(args, "control", None)
        if control is None:
            control = os.environ.get("WORKBENCH_CONTROL", "1").strip().lower() not in ("0", "false", "no", "off")
        self.control = control
        self.control_port = control_port if control_port is not None else getattr(args, "control_port", None)
        self.control_host = control_host if control_host is not None else getattr(args, "control_host", None)
        self._server: Any = None
        # run() trains in the caller's thread and serves until it returns; start() serves
        # until close() (or the process exits), so an ended run stays reachable.
        self._in_caller = False
        self._looping = False  # a run (or a chain of restarts) is under way (guarded by _lock)
        self._followup: tuple[Any, Future] | None = None  # what the worker does once this run ends
        self.successor: "Session | None" = None  # the branch a remote branch started from this run
        self._train_kwargs = dict(train_kwargs or {})
        # False for a Trainer.train() call (session/served.py): it trains its own Trainer only.
        self.branches_here = True
        self.train_output: Any = None  # train()'s TrainOutput, once a run has finished
        self._resume = resume_from_checkpoint
        self.origin = origin  # where a branched run came from
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._lock = threading.RLock()
        self._pause_requested = threading.Event()
        self._blocked = False  # the worker is waiting at a step boundary (guarded by _lock)
        self._interventions_cache: tuple[Any, tuple[Intervention, ...]] | None = None
        self._ended = threading.Event()  # set by the worker when the run is over
        self._unpaused = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._traceback: str | None = None
        self._status = Status.IDLE
        self._series = SeriesStore()
        self._events = EventHub()
        self._memory_failed = False  # warned once that the memory report cannot be taken
        self._edits: list[dict[str, Any]] = []
        self._started_at: float | None = None
        self._start_step = 0
        self._last_tick = 0.0
        self._pending_saves: list[Future] = []
        self._pending_evals: list[Future] = []
        self._memory: Any = None
        self._memory_at = 0.0
        self._catalog: tuple = ()
        self._snapshot = Snapshot.empty()
        # Several processes: rank 0's Session decides for all ranks (rank_sync.py); paused-time
        # saves and evaluations then run on the worker thread, which every rank follows.
        self._sync = trainer.rank_sync
        self._paused_actions: queue.Queue[tuple[str, Future]] = queue.Queue()
        if self._sync is not None and self._sync.is_main:
            self._sync.pause_wanted = self._pause_requested.is_set
            self._sync.apply_on_main = self._apply_edit_record
        # An interactive run pauses where the guard asks to (a pause action, max_interventions,
        # no progress); a headless one (the CLI clears this) and one of several processes stop
        # with a checkpoint instead, the same decision on every rank.
        self.pauses_for_guard = True
        self._gate = SessionGate(self)
        trainer.gates.set("steering", self._gate)
        self._callback = SessionObserver(self)
        trainer.add_callback(self._callback)

    # -- construction ----------------------------------------------------------------

    @classmethod
    def from_config(cls, path: str | Path, overrides: Any = None, resume_from_checkpoint: str | bool | None = None) -> "Session":
        """A Session for the run a config file describes (same validation as the CLI)."""
        from workbench.config.build import build_trainer
        from workbench.config.loader import load_config, write_resolved_config

        run = load_config(path, overrides)
        trainer = build_trainer(run)
        Path(run.training.output_dir).mkdir(parents=True, exist_ok=True)
        write_resolved_config(run, run.training.output_dir)
        session = cls(trainer, resume_from_checkpoint=resume_from_checkpoint)
        session.run_config = run
        return session

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> "Session":
        """Start training in a background thread and return at once."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError("this session is already running; pause(), stop() or wait() for it")
            self._error = self._traceback = None
            self._ended.clear()
            self._set_status(Status.RUNNING)
            self._thread = threading.Thread(target=self._work, name="workbench-train", daemon=True)
            self._in_caller, self._looping = False, True
            self._start_control()
            self._thread.start()
        return self

    def run(self) -> Status:
        """Train in the calling thread until the run ends, serving the control endpoint
        meanwhile; re-raise the run's error (KeyboardInterrupt included). The headless CLI
        and ``Trainer.train()`` with ``control = true`` use it, so signals and Ctrl-C stay
        where they were: in the main thread.

        The endpoint lives as long as this call. A remote ``checkpoints resume_from`` restarts
        the run here, in this thread; a remote ``branch`` ends this run and trains the branch
        here (``successor``), which then serves its own endpoint: the status returned, and any
        error raised, are the last run's."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError("this session is already running; pause(), stop() or wait() for it")
            self._error = self._traceback = None
            self._ended.clear()
            self._set_status(Status.RUNNING)
            self._thread = threading.current_thread()
            self._in_caller, self._looping = True, True
            self._start_control()
        try:
            self._work()
        finally:
            self._stop_control()
        if self.successor is not None:
            return self.successor.run()
        if self._error is not None:
            raise self._error
        return self._status

    def close(self) -> None:
        """Stop serving the control endpoint (control.json and the socket go). A run still
        going goes on without it (stop() ends a run). A Session started with start() keeps
        serving after its run has ended, so it can still be read, resumed from or branched
        from remotely, until close(), until it is garbage-collected (the endpoint holds it
        weakly) or the process exits."""
        self._stop_control()

    def detach(self) -> None:
        """Take this Session off its Trainer (its callback, its claim on the endpoint) and close
        its endpoint; the Trainer trains as a plain Trainer again."""
        self.close()
        self.trainer.remove_callback(self._callback)
        if self.trainer.control_owner is self:
            self.trainer.control_owner = None
        if self.trainer.gates.steering is self._gate:
            self.trainer.gates.set("steering", None)

    def _start_control(self) -> None:
        """Serve this run's control endpoint (rank 0 only). A failure to bind is a warning,
        never a reason not to train, except for a TCP port asked for explicitly: that is an
        EndpointError (one line), raised before the run writes anything."""
        if not self.control or self._server is not None or not self.trainer.is_world_process_zero():
            return
        from workbench.control.server import ControlServer

        # The server holds this Session weakly, and a Session dropped after its run (a notebook
        # variable reassigned) closes its endpoint when collected: serving an ended run must
        # never keep its model and optimizer state in memory.
        server = ControlServer(weakref.proxy(self), self.trainer.args.output_dir, port=self.control_port,
                               host=self.control_host)
        try:
            server.start()
        except (OSError, ValueError) as exc:
            if self.control_port is not None:  # asked for explicitly: the user must hear it failed
                from workbench.control.endpoint_check import EndpointError, bind_failure

                reason = bind_failure(server.host, self.control_port, exc, port_name="control_port",
                                      host_name="control_host") if isinstance(exc, OSError) else str(exc)
                raise EndpointError(reason) from None
            logging.getLogger("workbench").warning("control endpoint not started: %s", exc)
            return
        if self.control_port is not None:
            from workbench.control.endpoint_check import warn_if_public

            warn_if_public(server.host)  # once per process: the CLI may have said it already
        self._server = server
        self._server_closer = weakref.finalize(self, server.close, 0.2)

    def _stop_control(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            self._server_closer.detach()
            server.close()

    def _work(self) -> None:
        """Train, then whatever a remote resume_from or branch asked to follow; then end."""
        try:
            while True:
                self._train_once()
                with self._lock:
                    followup, self._followup = self._followup, None
                    if followup is None:
                        self._looping = False
                        break
                action, future = followup
                if isinstance(self._error, (KeyboardInterrupt, SystemExit)):  # the user ended it all
                    future.set_exception(RuntimeError(f"the run was interrupted ({type(self._error).__name__})"))
                    with self._lock:
                        self._looping = False
                    break
                try:
                    future.set_result(action())
                except BaseException as exc:  # noqa: BLE001 - reported to the remote caller
                    future.set_exception(exc)
                    with self._lock:
                        self._looping = False
                    break
                if self.successor is not None:  # a branch: this Session's run is over
                    with self._lock:
                        self._looping = False
                    break
        finally:
            self._ended.set()

    def _train_once(self) -> None:
        try:
            self.train_output = self.trainer.train(resume_from_checkpoint=self._resume, **self._train_kwargs)
        except BaseException as exc:  # noqa: BLE001 - surfaced through status, snapshot and wait()
            self._error = exc
            self._traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self._set_status(Status.FAILED)
            self._emit("failed", error=f"{type(exc).__name__}: {exc}",
                       **self._outcome(Status.FAILED, interrupted=isinstance(exc, KeyboardInterrupt)))
        else:
            stopped = self.trainer.stop_decision.is_set() or self.trainer.state.global_step < self.trainer.state.max_steps
            self._set_status(Status.STOPPED if stopped else Status.FINISHED)
            self._emit("finished", stopped=stopped, **self._outcome(self._status))
        finally:
            self._fail_pending()
            self._publish()

    def _outcome(self, status: Status, interrupted: bool = False) -> dict[str, Any]:
        """How the run ended, for its clients (the last event before the endpoint closes):
        status, stop reason, whether the stop saved, and the code ``workbench run`` exits
        with for it (events.jsonl's end record says the same for clients that come later)."""
        decision = self.trainer.stop_decision
        reason = decision.reason if decision.is_set() else None
        saved = bool(decision.save) if decision.is_set() else True
        return {"status": status.value, "stop_reason": reason, "saved": saved,
                "exit_code": run_exit_code(status.value, reason, saved, interrupted)}

    def wait(self, timeout: float | None = None) -> Status:
        """Block until the run ends (or ``timeout``); re-raise its error. Returns the status.

        Interrupting the kernel (KeyboardInterrupt) while waiting pauses the run and returns,
        instead of killing training.
        """
        thread = self._thread
        if thread is None:
            return self.status
        try:
            # Not thread.join(): on Python < 3.13 a KeyboardInterrupt inside join() marks a
            # running thread as stopped (is_alive() turns False while it keeps training).
            ended = self._ended.wait(timeout)
        except KeyboardInterrupt:
            self.pause()
            return self.status
        if ended:
            thread.join()
        if self._error is not None and not thread.is_alive():
            raise self._error
        return self.status

    @property
    def status(self) -> Status:
        """Where the run is (a str enum: idle, running, pausing, paused, evaluating, saving,
        stopping, finished, stopped or failed)."""
        return self._status

    @property
    def stop_reason(self) -> str | None:
        """Why the run was stopped ("SIGTERM", "SIGINT", "session", ...), None if it was not."""
        return self.trainer.stop_decision.reason

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the run, if it failed."""
        return self._error

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
        """Continue a paused run with exactly the state it had."""
        with self._lock:
            self._pause_requested.clear()
            if self._status in (Status.PAUSED, Status.PAUSING):
                self._set_status(Status.RUNNING)
                self._emit("resumed")
                self._log_event("resume")
            self._unpaused.notify_all()
        return self._status

    def stop(self, save: bool = True, reason: str = "session") -> Status:
        """Stop at the next safe point (step end or evaluation batch), saving a checkpoint first.

        ``reason``: who asks, for the end record and the exit code ("SIGHUP" from the CLI when
        the terminal closed; the front-ends' stops are the session's)."""
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

    def set(self, reason: str | None = None, **changes: Any) -> Future | dict[str, Any]:
        """Change hyperparameters live: learning_rate, lr_scale, max_steps, num_train_epochs,
        logging_steps, eval_steps, save_steps. Applied at once when paused, else at the next
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

    def _queue_paused_action(self, kind: str) -> Future:
        future: Future = Future()
        self._paused_actions.put((kind, future))
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

    # -- inspection ------------------------------------------------------------------------

    @property
    def args(self) -> Any:
        """The run's TrainingArguments, for reading (change hyperparameters live with set())."""
        return self.trainer.args

    @property
    def model(self) -> Any:
        """The model being trained (inspect it while paused)."""
        return unwrap_model(self.trainer.model)

    @property
    def last_batch(self) -> Any:
        """The inputs of the most recent micro-batch (inspect them while paused)."""
        return getattr(self.trainer, "last_inputs", None)

    def arguments(self) -> dict[str, Any]:
        """The run's TrainingArguments as a JSON-friendly dict (front-ends read this, not ``args``)."""
        import json

        return json.loads(self.trainer.args.to_json_string())

    def inspect(self) -> dict[str, Any]:
        """Per-layer parameter/gradient norms, update ratios, NaN/Inf counts and current LRs,
        as plain data; ``can_sample`` says whether sample() works for this model."""
        from workbench.session.inspection import can_sample, inspect_model

        with reading_the_model(self, "inspect", live_ok=True):  # a live reading never blocks a step
            return {**inspect_model(self.trainer), "can_sample": can_sample(self.trainer)}

    def sample(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int | None = 20,
               seed: int = 0) -> str:
        """Text generated by the paused causal LM from ``prompt`` (RNG state preserved): refused
        while the loop trains; at most MAX_SAMPLE_TOKENS new tokens (door/commands.py)."""
        from workbench.door.commands import check_sample_options
        from workbench.session.inspection import sample_text

        options = check_sample_options(prompt, max_new_tokens, temperature, top_k, seed)
        with reading_the_model(self, "sample", live_ok=False), rng_preserved():
            return sample_text(self.trainer, **options)

    def memory(self) -> MemoryUsage:
        """A fresh memory reading (parameters, gradients, optimizer state, device and host)."""
        from workbench.train.memory import memory_report

        return memory_report(self.model, self.trainer.optimizer, self.trainer.accelerator.device)

    # -- snapshot and events -------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The latest immutable view of the run (cheap: no locking, no device access)."""
        return self._snapshot

    def subscribe(self, maxsize: int = 10_000) -> queue.Queue:
        """A queue receiving every SessionEvent from now on (oldest dropped when full)."""
        return self._events.subscribe(maxsize)

    def unsubscribe(self, q: queue.Queue) -> None:
        """Stop delivering events to ``q``."""
        self._events.unsubscribe(q)

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        """The events after ``cursor`` and the cursor to pass next time: poll with
        ``events, cursor = session.events_since(cursor)``, starting from 0 (the run's first
        event). Only the newest EVENT_HISTORY events are kept: a reader further behind
        gets those. Plain request and answer, so a front-end in another process can poll
        it too."""
        return self._events.since(cursor)

    def events(self, timeout: float | None = None) -> Iterator[SessionEvent]:
        """Iterate over events as they happen until the run ends (or nothing arrives for ``timeout``)."""
        q = self.subscribe()
        try:
            while True:
                try:
                    event = q.get(timeout=timeout if timeout is not None else 0.25)
                except queue.Empty:
                    if timeout is not None or self._status in ENDED or self._status == Status.IDLE:
                        return
                    continue
                yield event
                if event.kind in ("finished", "failed"):
                    return
        finally:
            self.unsubscribe(q)

    def panel(self) -> Any:
        """The Jupyter panel for this session (needs ipywidgets)."""
        # Imported here only: the session layer never imports a front-end at module level
        # (front-ends depend on the session, not the other way round).
        from workbench.widgets.notebook import Panel

        return Panel(self)

    # -- worker-side hooks (called from SessionGate and SessionObserver) ----------------------------------------------

    def _on_train_begin(self, state) -> None:
        self._started_at = time.perf_counter()
        self._start_step = state.global_step
        # A resumed run's edits come with its checkpoint.
        self._edits = [dict(e) for e in self.trainer.workbench_state.live_edits]
        self._refresh_catalog()
        self._emit("started", max_steps=state.max_steps)

    def _refresh_catalog(self) -> None:
        try:
            self._catalog = tuple(self.checkpoints)
        except OSError:  # an unreadable folder keeps the last catalog; the next save retries
            pass

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
            paused_at = time.perf_counter()
            self._blocked = True
            try:
                while self._pause_requested.is_set() and not self.trainer.stop_request.is_set():
                    self._unpaused.wait(0.5)
            finally:
                self._blocked = False
            # Time spent paused is not training time: keep throughput and ETA honest.
            if self._started_at is not None:
                self._started_at += time.perf_counter() - paused_at
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

    def _tick(self, state) -> None:
        now = time.perf_counter()
        if now - self._last_tick >= 0.1:  # the live view refreshes at most 10 times a second
            self._last_tick = now
            if now - self._memory_at >= 1.0:  # memory is sampled, not read per step
                self._memory_at = now
                try:
                    self._memory = self.memory()
                except Exception as exc:  # noqa: BLE001 - a report must never end the run
                    if not self._memory_failed:
                        self._memory_failed = True
                        logging.getLogger("workbench").warning("memory report unavailable (%s: %s); the run goes on without it",
                                    type(exc).__name__, exc)
            self._publish()

    def _on_log(self, state, logs: dict[str, Any]) -> None:
        with self._lock:  # snapshot() readers iterate the series under the same lock
            self._series.add_log(state.global_step, logs)
        if "loss" in logs:
            self._emit("logged", **logs)
        self._publish()

    def _on_evaluate(self, state, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._series.add_eval(state.global_step, metrics)
        futures, self._pending_evals = self._pending_evals, []
        for f in futures:
            f.set_result(dict(metrics))
        self._set_status(Status.RUNNING, only_from=(Status.EVALUATING,))
        self._emit("evaluated", **metrics)
        self._publish()

    def _on_save(self, state) -> None:
        path = Path(self.trainer.args.output_dir) / f"checkpoint-{state.global_step}"
        futures, self._pending_saves = self._pending_saves, []
        self._set_status(Status.RUNNING, only_from=(Status.SAVING,))

        def published(write: Future | None = None) -> None:
            error = write.exception() if write is not None else None
            for f in futures:
                if error is not None:
                    f.set_exception(error)
                else:
                    f.set_result(path)
            if error is None:
                self._refresh_catalog()
                self._emit("saved", checkpoint=str(path))
            self._publish()

        pending = self.trainer.checkpoint_writer.pending
        if self.trainer.args.save_async and pending is not None and not pending.done():
            pending.add_done_callback(published)  # save_async: done once the files are published
        else:
            published()

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

    # -- caller-side actions while paused ------------------------------------------------------------

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
        for key, value in sorted(changes.items(), key=lambda kv: kv[0] not in ("max_steps", "num_train_epochs")):
            applied[key] = apply_edit(trainer, key, value)
        why = {"reason": reason} if reason else {}  # no empty "reason" keys in old-style records
        record = {"step": trainer.state.global_step, "time": time.time(), **applied, **why}
        trainer.workbench_state.live_edits.append(record)
        self._edits.append(record)
        from workbench.core.event_file import EventFile

        if trainer.is_world_process_zero():
            EventFile(trainer.args.output_dir).write("edit", trainer.state.global_step, **applied, **why)
        self._emit("edited", **applied, **why)
        self._publish()
        return applied

    # -- status, events, snapshot -------------------------------------------------------------------------

    def _set_status(self, status: Status, only_from: tuple[Status, ...] | None = None) -> None:
        with self._lock:
            if only_from is not None and self._status not in only_from:
                return
            if self._status == status:
                return
            self._status = status
        self._publish()

    def _log_event(self, event: str, **fields: Any) -> None:
        """Append ``event`` to the run's events.jsonl (main process only)."""
        from workbench.core.event_file import EventFile

        if self.trainer.is_world_process_zero():
            EventFile(self.trainer.args.output_dir).write(event, self.trainer.state.global_step, **fields)

    def _emit(self, kind: str, **data: Any) -> None:
        self._events.emit(kind, self.trainer.state.global_step, **data)

    def _publish(self) -> None:
        # Serialized, so a thread that read older values can never overwrite a newer snapshot.
        with self._lock:
            self._publish_locked()

    def _interventions(self, records: Any) -> tuple[Intervention, ...]:
        """The guard's records as value types, rebuilt only when they changed (they are few
        and change rarely; a snapshot is published several times a second)."""
        # Records are only appended (a rollback fills its own in before it is published).
        key = (len(records), records[-1].get("step"), records[-1].get("restored_step")) if records else (0,)
        cached = self._interventions_cache
        if cached is None or cached[0] != key:
            # The newest only: every poll of every client carries them (guard_interventions counts all).
            newest = records[-SNAPSHOT_INTERVENTIONS:]
            cached = self._interventions_cache = (key, tuple(Intervention.from_record(r) for r in newest))
        return cached[1]

    def _publish_locked(self) -> None:
        from workbench.session.progress import progress

        state, args = self.trainer.state, self.trainer.args
        interventions = (self.trainer.workbench_state.guard or {}).get("interventions", ())
        self._snapshot = replace(
            self._snapshot,
            status=self._status,
            step=state.global_step,
            max_steps=state.max_steps,
            epoch=state.epoch,
            **progress(self.trainer, self._started_at, self._start_step),
            memory=self._memory,
            checkpoints=self._catalog,
            series=self._series.frozen(),
            best_metric=state.best_metric,
            best_step=state.best_global_step,
            edits=tuple(dict(e) for e in self._edits[-SNAPSHOT_EDITS:]), edit_count=len(self._edits),
            guard_interventions=len(interventions),
            interventions=self._interventions(interventions),
            error=f"{type(self._error).__name__}: {self._error}" if self._error is not None else None,
            traceback=self._traceback,
            run_name=args.run_name or str(args.output_dir),
            output_dir=str(args.output_dir),
            device=str(self.trainer.accelerator.device),
            updated=time.time(),
        )
