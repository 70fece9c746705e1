"""Session: train in a background thread, and pause, inspect, edit, save or evaluate it.

This module is the Session's thread and its lifecycle: start (a worker thread) or run (the
caller's thread), the control endpoint it serves, the run's end and the restarts a remote
``resume_from`` or ``branch`` asks for. Its other jobs are mixins, one a module:
commands.py (pause, stop, save, evaluate, edits: checked here once for every front-end, and
turned into flags by the Session's steering gate in the loop), publishing.py (the immutable
snapshot and the events front-ends read), checkpoint_commands.py (the catalog, resume
from and branch from a checkpoint), fork_commands.py (A/B forks) and proposals.py (changes
proposed to the run, decided by anyone attached). Front-ends never touch the trainer: they use the
``SessionLike`` protocol (workbench/door/protocol.py).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
import weakref
from concurrent.futures import Future
from pathlib import Path
from collections.abc import Callable
from typing import Any

from workbench.core.exit_codes import run_exit_code
from workbench.core.rng import rng_preserved
from workbench.core.trainer_utils import unwrap_model
from workbench.core.callbacks import TrainerCallback
from workbench.core.run import Gate
from workbench.door.schedule import ScheduleSteering
from workbench.door.values import Intervention, MemoryUsage, SeriesStore, SessionEvent, Snapshot, Status
from workbench.session.checkpoint_commands import CheckpointCommands
from workbench.session.commands import SessionCommands, _Command
from workbench.session.progress import PauseClock
from workbench.train.callbacks import ProgressCallback
from workbench.session.events import EventHub
from workbench.session.fork_commands import ForkCommands
from workbench.session.loop_hold import reading_the_model
from workbench.session.proposals import ProposalBook, ProposalCommands
from workbench.session.publishing import SessionPublishing
from workbench.train.trainer import Trainer

__all__ = ["Session", "SessionGate", "SessionObserver", "Snapshot", "SessionEvent", "Status"]


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

    def on_sample(self, args, state, control, samples=None, **kwargs):
        self.session._on_sample(state, samples or [])


class Session(SessionCommands, SessionPublishing, CheckpointCommands, ForkCommands, ProposalCommands,
              ScheduleSteering):
    """A training run you can watch and steer from notebooks, terminals and scripts."""

    def __init__(self, trainer: Trainer, resume_from_checkpoint: str | bool | None = None,
                 origin: dict[str, Any] | None = None, guard: Any = None, control: bool | None = None,
                 control_port: int | None = None, control_host: str | None = None,
                 train_kwargs: dict[str, Any] | None = None) -> None:
        self.trainer = trainer
        trainer.control_owner = self  # this Session decides about the endpoint, not args.control
        if guard is not None:  # a Guard given here replaces the trainer's (workbench/guard/)
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
        self._proposal_book = ProposalBook()  # changes proposed to this run, for anyone attached to decide
        self._started_at: float | None = None  # on the pause clock: training time, pauses left out
        self._pause_clock = PauseClock()
        # Where the run tells what its control clients did, one line each ("paused from workbench
        # ctl at step 40"): the CLI's headless console sets it before the run; None: untold.
        self.announce: Callable[[str], None] | None = None
        for printer in trainer.callback_handler.callbacks:  # headless progress lines: training time too
            if isinstance(printer, ProgressCallback):
                printer.clock, printer.paused = self._pause_clock.now, self._pause_clock.paused
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
        # A hang is found by a watchdog thread while the training thread is stuck, so it is
        # published from there (the training thread's hooks would never run).
        trainer.health_listeners = [*getattr(trainer, "health_listeners", []), self._on_health]
        # The run's own edits (an out-of-memory recovery's cut) and this Session's reach the
        # snapshot and the events through one path (core/edits.py record_edit).
        trainer.edit_listeners = [*getattr(trainer, "edit_listeners", []), self._on_run_edit]

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

    @classmethod
    def running(cls) -> "Session | None":
        """The Session whose run is training in this process (paused included), or None.

        One run trains per process (workbench/train/one_run.py says why); a notebook cell run
        again has lost the old Session's name, and this finds it to stop: ``Session.running().stop()``.
        """
        from workbench.train.one_run import training_run

        owner = getattr(training_run(), "control_owner", None)
        return owner if isinstance(owner, cls) else None

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
        server.announce = self.announce
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

    def panel(self, autopilot: Any = None) -> Any:
        """The Jupyter panel for this session (needs ipywidgets); with ``autopilot`` (an
        Autopilot steering it from this kernel), a tab to accept or reject its proposals."""
        # Imported here only: the session layer never imports a front-end at module level
        # (front-ends depend on the session, not the other way round).
        from workbench.widgets.notebook import Panel

        return Panel(self, autopilot=autopilot)

