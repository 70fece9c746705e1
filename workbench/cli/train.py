"""``workbench run``: build the run from its config, then train it headless (progress
lines; rank 0 serves the control endpoint through a Session) or under the dashboard, and
say in one line how it ended, with the exit code that goes with it (core/exit_codes.py).
A closed terminal is handled in hangup.py."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from workbench.cli.hangup import HangupWatch
from workbench.cli.output_dir import owned_output_dir
from workbench.cli.usage import UsageError
from workbench.core.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, OUTCOME_CODES, run_exit_code

__all__ = ["run_command", "load_run_config", "check_control"]


def join_world(run) -> None:
    """Make the run's distributed state now, before anything else asks for it (world.py)."""
    from workbench.core.world import WorldSizeMismatch, distributed_state, launched_world_size

    try:
        distributed_state(run.training)
    except WorldSizeMismatch as exc:
        raise UsageError(str(exc)) from None
    except (ValueError, RuntimeError) as exc:
        world = launched_world_size()
        if world is None or world[0] <= 1:
            raise
        raise UsageError(f"{world[1]}={world[0]} says this is one of {world[0]} processes, but the process group "
                         f"could not start ({str(exc).splitlines()[0]}); start the processes with "
                         "'workbench run --num-processes N', 'accelerate launch' or 'torchrun'") from None


def load_run_config(ns: argparse.Namespace):
    """The run's config with the command line's overrides; problems become one-line usage errors."""
    from workbench.config.loader import ConfigError, load_config

    config_path = Path(ns.config)
    if not config_path.is_file():
        raise UsageError(f"{config_path}: no such config file; create one with 'workbench init {config_path}'")
    try:
        return load_config(config_path, ns.overrides)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def run_command(ns: argparse.Namespace) -> int:
    run = load_run_config(ns)
    join_world(run)
    check_control(ns, run)
    # The model and the data are built and checked before anything is written into
    # output_dir: a broken data file or a bad argument leaves no folder behind.
    with owned_output_dir(run, ns, prepare=lambda: build_run_trainer(ns, run)) as (resume, trainer):
        return train_run(ns, run, trainer, resume)


def check_control(ns: argparse.Namespace, run) -> None:
    """The TCP endpoint asked for (on the command line, else in ``[training]``) is checked and
    its port bound once now, before anything is written (rank 0 serves it)."""
    from workbench.core.world import is_main_process

    if ns.no_control or run.training.control is False or not is_main_process():
        return
    from workbench.control.endpoint_check import EndpointError, check_run_endpoint

    try:
        warning = check_run_endpoint(ns.control_port, ns.control_host, run.training)
    except EndpointError as exc:
        raise UsageError(str(exc)) from None
    if warning:
        print(f"workbench: {warning}", file=sys.stderr)


def build_run_trainer(ns: argparse.Namespace, run):
    """The run's Trainer (model, data, hooks); a problem in them is a one-line usage error."""
    from workbench.config.build import build_trainer
    from workbench.data.file_errors import DataFileError

    try:
        return build_trainer(run)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # a DataFileError names its file and line
        if isinstance(exc, DataFileError):
            raise UsageError(str(exc)) from None
        from workbench.config.locate import locate_build_error

        # A model refusing its options (n_head must divide n_embd) is told at the option's line.
        raise UsageError(locate_build_error(str(exc), run.path or ns.config, str(ns.config), ns.overrides)) from None


def train_run(ns: argparse.Namespace, run, trainer, resume: object) -> int:
    from workbench.config.loader import write_resolved_config
    from workbench.distributed.signals import install_stop_handlers

    output_dir = Path(run.training.output_dir)
    main_rank = trainer.is_world_process_zero()
    if main_rank:
        write_resolved_config(run, output_dir)
    if main_rank and not ns.headless and sys.stdout.isatty():
        return run_dashboard_run(ns, trainer, resume, output_dir)
    session = None
    if main_rank and not ns.no_control and trainer.args.control is not False:
        # Rank 0 trains through a Session in this (main) thread, so the run serves its
        # control endpoint (workbench ctl / attach); the other ranks follow its decisions.
        from workbench.session.local import Session

        session = Session(trainer, resume_from_checkpoint=resume, control=True, control_port=ns.control_port,
                          control_host=ns.control_host)
        # Headless: no one is there to resume a guard's pause (max_interventions, the pause
        # action), which would hang the run; it stops with a checkpoint instead (README).
        session.pauses_for_guard = False
        # What workbench ctl or an attached dashboard does to this run is told in its own output.
        session.announce = lambda text: print(f"workbench: {text}", file=sys.stderr, flush=True)
    elif ns.no_control:
        trainer.args.control = False  # --no-control wins over the config's control = true

    def current():
        """The Trainer this process trains now: a remote branch hands the process to its run."""
        run = session
        while run is not None and run.successor is not None:
            run = run.successor
        return run.trainer if run is not None else trainer

    def abort(signum: int) -> None:
        # A second Ctrl-C: stop now, without waiting for the save. Under a plain
        # `accelerate launch` every rank gets the terminal's SIGINT and then the launcher's
        # copy a moment later; that echo is not a second press.
        if trainer.accelerator.num_processes > 1 and time.monotonic() - (current().stop_request.set_at or 0) < 2.0:
            return
        raise KeyboardInterrupt

    # Ctrl-C and a closed terminal (SIGHUP) ask for the same save-and-stop as SIGTERM; the
    # Trainer routes SIGTERM itself when enable_jit_checkpoint is set (schedulers then see
    # 143, "preempted").
    restore = install_stop_handlers(CurrentStop(current), [signal.SIGINT], on_repeat=abort)
    try:
        with HangupWatch(stop=lambda: CurrentStop(current).set("SIGHUP")):
            if session is not None:
                session.run()
            else:
                trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:  # a second Ctrl-C: the save the first one asked for was not waited for
        from workbench.door.endings import describe_end

        ended = current()
        where = str(ended.args.output_dir)
        print(f"\nworkbench: {describe_end('stopped', 'SIGINT', ended.state.global_step, False, where)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        from workbench.control.failure_report import report_failure

        return report_failure(exc, Path(current().args.output_dir))
    finally:
        restore()
    if current() is not trainer:  # the run was branched: report on the branch
        trainer = current()
        output_dir = Path(trainer.args.output_dir)
    request = trainer.stop_request
    step = trainer.state.global_step
    reason = trainer.stop_decision.reason  # with several ranks: whichever rank was signalled
    say = print if main_rank else (lambda *a, **k: None)
    from workbench.door.endings import describe_end, describe_guard_stop

    if reason in (None, "guard") and step < trainer.state.max_steps and stopped_by_guard(trainer):
        count = len(trainer.workbench_state.guard["interventions"])
        stuck = (trainer.workbench_state.guard.get("progress") or {}).get("escalated")
        say(f"workbench: {describe_guard_stop(step, count, stuck, str(output_dir / 'events.jsonl'), str(output_dir))}",
            file=sys.stderr)
    elif reason:  # a signal, workbench ctl, a script: the words every front-end uses (door/endings.py)
        say(f"workbench: {describe_end('stopped', reason, step, bool(request.save), where=str(output_dir))}",
            file=sys.stderr)
    else:
        status = "finished" if step >= trainer.state.max_steps else "stopped"  # an early-stopping callback
        say(f"workbench: {describe_end(status, None, step, saved=None, where=str(output_dir))}")
    return run_exit_code("stopped" if reason else "finished", reason, saved=request.save)


class CurrentStop:
    """The stop request of the run this process trains now, for the signal handler (a remote
    branch replaces the run, and Ctrl-C must stop the branch)."""

    def __init__(self, current) -> None:
        self._current = current

    def set(self, reason: str, save: bool = True) -> bool:
        """Request a stop of the current run (False when one was already requested)."""
        return self._current().stop_request.set(reason, save)


def stopped_by_guard(trainer) -> bool:
    """Whether the guard ended this run early: its last intervention asked to stop or pause
    (headless, a pause stops), or reached ``max_interventions``."""
    saved = trainer.workbench_state.guard or {}
    guard, records = trainer.guard, saved.get("interventions") or []
    if guard is None or not records:
        return False
    if (saved.get("progress") or {}).get("escalated"):
        return True
    limit = guard.max_interventions
    return records[-1]["action"] in ("stop", "pause") or (limit is not None and len(records) >= limit)


def run_dashboard_run(ns: argparse.Namespace, trainer, resume: object, output_dir: Path) -> int:
    """The dashboard path: a Session trains in its thread while the app owns the terminal.

    The app returns an outcome; its exit code follows core/exit_codes.py (q then Enter saves and
    exits 0). Messages are printed after the app has given the terminal back.
    """
    from workbench.checkpoint.lock import release_held
    from workbench.session.local import Session
    from workbench.door.protocol import ENDED
    from workbench.train.callbacks import PrinterCallback, ProgressCallback
    from workbench.widgets.tui import run_dashboard

    for printer in (ProgressCallback, PrinterCallback):  # the dashboard shows progress; prints would tear it
        trainer.remove_callback(printer)
    serve = not ns.no_control and trainer.args.control is not False  # as headless: on unless turned off
    session = Session(trainer, resume_from_checkpoint=resume, control=serve,
                      control_port=ns.control_port, control_host=ns.control_host)

    def last_run():
        run = session
        while run.successor is not None:
            run = run.successor
        return run

    def finish() -> None:
        """The terminal is gone: the run's checkpoint and end record, then nothing held."""
        last_run().wait()
        run = session
        while run is not None:
            run.close()  # its endpoint and control.json
            run = run.successor
        release_held(output_dir)

    with HangupWatch(stop=lambda: last_run().stop(save=True, reason="SIGHUP"), finish=finish):
        outcome = run_dashboard(session)
    # A branch (made in the dashboard or by a remote `checkpoints branch`) takes this process
    # over: the dashboard follows it, and what is reported below is the last run's.
    run = session
    while True:
        if outcome != "aborted":  # a second ctrl+c means: do not wait for the save
            if run is not session and run.status not in ENDED:  # the dashboard was left before it
                print(f"workbench: training the branch in {run.trainer.args.output_dir} until it ends "
                      f"(workbench attach {run.trainer.args.output_dir})", file=sys.stderr)
            try:
                run.wait()
            except BaseException:  # noqa: BLE001 - reported below from the run's error
                pass
        if run.successor is None:
            break
        run = run.successor
    output_dir = Path(run.trainer.args.output_dir)
    step = run.snapshot().step
    if outcome == "failed" or run.error is not None:
        from workbench.control.failure_report import recorded_in, report_failure

        if run.error is not None:
            return report_failure(run.error, output_dir)
        print(f"workbench: training failed{recorded_in(output_dir)}", file=sys.stderr)
        return EXIT_FAILED
    from workbench.door.endings import describe_dashboard_failure, describe_end

    reason = run.stop_reason
    if outcome == "crashed":  # run_dashboard stopped a live run with a checkpoint; one that had ended is said so
        saved = run.trainer.stop_decision.save is not False if reason else None
        print(f"workbench: {describe_dashboard_failure(str(run.status), reason, step, saved, str(output_dir))}",
              file=sys.stderr)
    elif outcome == "hangup":
        print(f"workbench: {describe_end('stopped', 'SIGHUP', step, True, str(output_dir))}", file=sys.stderr)
    elif outcome == "aborted":  # a second ctrl+c: the save was not waited for
        print(f"workbench: {describe_end('stopped', 'SIGINT', step, False, str(output_dir))}", file=sys.stderr)
    elif reason or outcome in ("saved", "interrupted", "terminated", "stopped"):
        # Who stopped it: the dashboard, a signal, workbench ctl or the guard (door/endings.py).
        saved = outcome != "stopped" and run.trainer.stop_decision.save is not False
        print(f"workbench: {describe_end('stopped', reason, step, saved, str(output_dir))}", file=sys.stderr)
    else:
        print(f"workbench: {describe_end(str(run.status), None, step, saved=None, where=str(output_dir))}")
    return OUTCOME_CODES.get(outcome, EXIT_FAILED)


