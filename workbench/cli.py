"""``workbench run | ctl | attach | watch | checkpoints | init``.

Exit codes (DESIGN.md): 0 finished; 2 usage or config error (one line on stderr, nothing
written); 1 training failed (a traceback, or one line for a full or read-only disk; the
error record in events.jsonl); 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.checkpoint.lock import OutputDirLock

from workbench.core.exit_codes import (  # noqa: F401 - re-exported for callers of the CLI
    EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_RUN, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE, OUTCOME_CODES, run_exit_code)
from workbench.hangup import HangupWatch

__all__ = ["main"]


class UsageError(Exception):
    """A problem the user can fix by changing the command line or the files."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="See and steer PyTorch training runs.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train from a config file")
    run.add_argument("config", help="path to a TOML config (see 'workbench init')")
    run.add_argument("--headless", action="store_true", help="print progress lines instead of the dashboard")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set training.learning_rate=1e-4 (repeatable)")
    run.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                     help="resume from CHECKPOINT, or from the newest complete checkpoint in output_dir")
    run.add_argument("--overwrite", action="store_true",
                     help="start over in an output_dir that already holds checkpoints (deletes them)")
    run.add_argument("--num-processes", type=int, default=None, metavar="N",
                     help="train on N processes through Accelerate's launcher (one per GPU, or CPU ranks)")
    run.add_argument("--accelerate-config", default=None, metavar="FILE",
                     help="an 'accelerate config' file for --num-processes (default: accelerate's own default)")

    run.add_argument("--no-control", action="store_true",
                     help="serve no control endpoint (workbench ctl / attach cannot reach this run)")
    run.add_argument("--control-port", type=int, default=None, metavar="N",
                     help="serve the control endpoint on TCP port N (0: any free port; a token is required) "
                          "instead of a Unix socket")
    run.add_argument("--control-host", default=None, metavar="ADDRESS",
                     help="the address --control-port binds (default 127.0.0.1; name another only on a "
                          "trusted network)")

    ctl = sub.add_parser("ctl", help="steer a live run: status, pause, resume, save, eval, stop, set, checkpoints")
    ctl.add_argument("target", metavar="OUTDIR|HOST:PORT")
    ctl.add_argument("action", metavar="COMMAND")
    ctl.add_argument("values", nargs="*", metavar="ARGS",
                     help="set: KEY=VALUE ...; checkpoints: list, delete NAME, resume_from NAME [KEY=VALUE ...], "
                          "branch NAME NEWDIR [KEY=VALUE ...]")
    ctl.add_argument("--json", action="store_true", help="print the reply as JSON")
    ctl.add_argument("--wait", action="store_true", help="pause: return once the run is paused")
    ctl.add_argument("--no-save", action="store_true",
                     help="stop, checkpoints branch: stop the run without its final checkpoint")
    ctl.add_argument("--token", default=None, help="the TCP endpoint's token (read from control.json for an OUTDIR)")
    ctl.add_argument("--reason", default=None, metavar="TEXT",
                     help="set: why (kept with the edit in events.jsonl and the next checkpoint)")

    attach = sub.add_parser("attach", help="open the dashboard on a live run elsewhere (q detaches)")
    attach.add_argument("target", metavar="OUTDIR|HOST:PORT")
    attach.add_argument("--token", default=None, help="the TCP endpoint's token")

    watch = sub.add_parser("watch", help="a finished or live run, read-only")
    watch.add_argument("output_dir")

    ckpt = sub.add_parser("checkpoints", help="list the checkpoints of an output directory")
    ckpt.add_argument("output_dir")
    ckpt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ckpt.add_argument("--quick", action="store_true",
                      help="check each checkpoint's file sizes only, not its sha256 hashes (fast on large "
                           "checkpoints; the state column then says the hashes were not checked)")
    ckpt.add_argument("--reseal", metavar="NAME", default=None,
                      help="accept a checkpoint's files as they are now (e.g. resharded weights): list what "
                           "differs from its manifest, then rewrite the manifest")

    init = sub.add_parser("init", help="write a commented starter config that runs as is")
    init.add_argument("path", nargs="?", default="workbench.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``workbench`` command; returns the process exit code."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    try:
        if ns.command == "init":
            return _init(ns)
        if ns.command == "checkpoints":
            return _checkpoints(ns)
        if ns.command == "ctl":
            from workbench.control.ctl import run_ctl

            return run_ctl(ns.target, ns.action, ns.values, as_json=ns.json, wait=ns.wait, save=not ns.no_save,
                           token=ns.token, reason=ns.reason)
        if ns.command == "attach":
            return _attach(ns)
        if ns.command == "watch":
            return _watch(ns)
        if ns.num_processes is not None and "WORLD_SIZE" not in os.environ:
            return _launch(ns, argv)
        return _finish_rank(_run(ns))
    except UsageError as exc:
        print(f"workbench: {exc}", file=sys.stderr)
        return _finish_rank(EXIT_USAGE)


def _finish_rank(code: int) -> int:
    """Under ``--num-processes`` rank 0 reports the code to the parent (see launch.py)."""
    from workbench.distributed.launch import report_exit_code

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and code in (EXIT_OK, EXIT_INTERRUPTED, EXIT_TERMINATED):
            # All ranks leave together: a rank tearing gloo down while another still talks
            # to it can abort at interpreter exit. Not after a failure: the other ranks may
            # be inside a collective this rank will never join, and the launcher ends them.
            dist.barrier()
            dist.destroy_process_group()
    from workbench.core.world import is_main_process

    return report_exit_code(code, is_main=is_main_process())


def _strip_launch_options(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--num-processes", "--accelerate-config"):
            skip = True
            continue
        # The parent has already cleared an --overwrite'd output_dir under its lock.
        if arg.startswith(("--num-processes=", "--accelerate-config=")) or arg == "--overwrite":
            continue
        out.append(arg)
    return out


def _launch(ns: argparse.Namespace, argv: list[str]) -> int:
    """Check the config here (errors stay one line), then start the ranks through Accelerate."""
    from workbench.distributed.launch import launch_ranks

    if ns.num_processes < 1:
        raise UsageError(f"--num-processes: {ns.num_processes} is not a process count; pass 1 or more")
    from workbench.checkpoint.lock import OWNER_ENV

    run = _load_run_config(ns)
    _check_control(ns, run)
    # The parent holds the output_dir's lock for the whole run; rank 0 recognises it as its own.
    with _owned_output_dir(run, ns):
        try:
            return launch_ranks(ns.num_processes, _strip_launch_options(argv), ns.accelerate_config,
                                extra_env={OWNER_ENV: str(os.getpid())})
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None


def _init(ns: argparse.Namespace) -> int:
    from workbench.config.loader import starter_config_text

    path = Path(ns.path)
    if path.exists() and not ns.force:
        raise UsageError(f"{path} already exists; choose another path or pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(starter_config_text(), encoding="utf-8")
    print(f"wrote {path}; run it with: workbench run {path}")
    return EXIT_OK


def _checkpoints(ns: argparse.Namespace) -> int:
    from workbench.checkpoint.listing import json_rows, table_lines, verified_rows
    from workbench.checkpoint.store import CheckpointStore

    root = Path(ns.output_dir)
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory; pass a run's output_dir")
    if ns.reseal is not None:
        return _reseal(CheckpointStore(root), ns.reseal)
    rows = verified_rows(CheckpointStore(root), quick=ns.quick)
    if ns.json:
        print(json.dumps(json_rows(rows, quick=ns.quick), indent=2))
    elif not rows:
        print(f"no checkpoints in {root}")
    else:
        print("\n".join(table_lines(rows, quick=ns.quick)))
    return EXIT_OK


def _reseal(store, name: str) -> int:
    from workbench.checkpoint.listing import reseal_lines

    try:
        print("\n".join(reseal_lines(store, name)))
    except ValueError as exc:
        raise UsageError(f"--reseal: {exc}") from None
    return EXIT_OK


def _plan_output_dir(output_dir: Path, resume: object, overwrite: bool) -> tuple[object, bool]:
    """What to resume from, and whether old checkpoints are to be cleared; changes nothing.

    Refuses to clobber saved work, and checks an explicit ``--resume PATH`` before anything is
    created. Under several ranks only rank 0 speaks.
    """
    from workbench.checkpoint.store import CheckpointStore, refused_text
    from workbench.core.world import is_main_process

    store = CheckpointStore(output_dir)
    if resume is not None and resume is not True:
        try:  # a bare name (checkpoint-88, as `workbench checkpoints` lists them) is one of output_dir's
            path = store.named(str(resume))
        except LookupError as exc:
            raise UsageError(f"--resume: {exc}") from None
        _check_resume_path(path)
        return str(path), False
    if resume is True:
        found, refused = store.newest_usable()
        if found is not None or store.foreign_fallback() is not None:
            return True, False
        if refused:
            # A requeued job must not start over on top of saved work it cannot read.
            raise UsageError(f"--resume: no checkpoint in {output_dir} verifies: {refused_text(refused)}; "
                             f"nothing was started or changed. Accept one as it is with 'workbench checkpoints "
                             f"{output_dir} --reseal NAME', or start over with --overwrite")
        if is_main_process():
            print(f"workbench: no complete checkpoint in {output_dir}; starting fresh", file=sys.stderr)
        return None, False
    complete = [c for c in store.list() if c.complete]
    if complete and not overwrite:
        raise UsageError(
            f"{output_dir} already holds checkpoints ({', '.join(c.name for c in complete[-3:])}); "
            "use --resume to continue or --overwrite to start over"
        )
    return None, bool(complete and overwrite)


def _check_resume_path(path: Path) -> None:
    """``--resume PATH`` must name a complete checkpoint folder (sizes checked, nothing hashed:
    the Trainer verifies the hashes when it loads), or one transformers' Trainer wrote."""
    from workbench.checkpoint.store import MANIFEST, CheckpointStore

    hint = "pass a checkpoint folder (see 'workbench checkpoints OUTPUT_DIR'), or --resume alone for the newest"
    if not path.exists():
        raise UsageError(f"--resume: {path} does not exist; {hint}")
    if not path.is_dir():
        raise UsageError(f"--resume: {path} is a file, not a checkpoint folder; {hint}")
    if not (path / "trainer_state.json").is_file():
        rows = CheckpointStore(path).list()
        if rows:
            raise UsageError(f"--resume: {path} is an output_dir, not a checkpoint; pass one of its checkpoints "
                             f"(newest: {rows[-1].path}) or use --resume alone with that output_dir")
        raise UsageError(f"--resume: {path} is not a checkpoint (it has no trainer_state.json); {hint}")
    store = CheckpointStore(path.parent)
    # A checkpoint of transformers' Trainer has no manifest: its layout is checked instead.
    ok, why = store.verify(path, hashes=False) if (path / MANIFEST).is_file() else store.structural_check(path)
    if not ok:
        raise UsageError(f"--resume: {path} cannot be used: {why}; {hint}")


def _claim_output_dir(output_dir: Path) -> "OutputDirLock | None":
    """Create the output_dir, check it is writable, and (rank 0) take its lock."""
    from workbench.checkpoint.lock import OutputDirBusy, OutputDirLock, check_writable
    from workbench.core.world import is_main_process

    try:
        check_writable(output_dir)
    except OSError as exc:
        raise UsageError(f"training.{exc}") from None
    if not is_main_process():
        return None
    lock = OutputDirLock(output_dir, reentrant=True)
    try:
        took_over = lock.acquire()
    except OutputDirBusy as exc:
        raise UsageError(str(exc)) from None
    if took_over:
        print(f"workbench: {took_over}", file=sys.stderr)
    return lock


@contextlib.contextmanager
def _owned_output_dir(run, ns: argparse.Namespace, prepare=None) -> Iterator[tuple[object, object]]:
    """Check the output_dir and ``--resume`` (nothing created on a refusal), run ``prepare``
    (building the Trainer: model and data, all checked) while nothing is written yet, then
    hold the folder's lock for the block; yields (resume_from_checkpoint, prepare's result)."""
    from workbench.checkpoint.lock import OutputDirBusy, check_not_busy, check_writable
    from workbench.core.world import is_main_process

    output_dir = Path(run.training.output_dir)
    resume, clear = _plan_output_dir(output_dir, ns.resume, ns.overwrite)
    if prepare is not None:
        try:
            if is_main_process():  # the others' folder is rank 0's: it has the lock
                check_not_busy(output_dir)
            check_writable(output_dir, create=False)
        except (OutputDirBusy, OSError) as exc:
            raise UsageError(str(exc) if isinstance(exc, OutputDirBusy) else f"training.{exc}") from None
    prepared = prepare() if prepare is not None else None
    lock = _claim_output_dir(output_dir)
    try:
        if clear:
            _clear_checkpoints(output_dir)
        yield resume, prepared
    finally:
        if lock is not None:
            lock.release()


def _clear_checkpoints(output_dir: Path) -> None:
    """--overwrite: delete the old checkpoints and event log (rank 0, under the lock)."""
    from workbench.checkpoint.store import CheckpointStore
    from workbench.core.world import is_main_process

    if not is_main_process():
        return
    for info in CheckpointStore(output_dir).list():
        shutil.rmtree(info.path, ignore_errors=True)
    (output_dir / "events.jsonl").unlink(missing_ok=True)


def _join_world(run) -> None:
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


def _load_run_config(ns: argparse.Namespace):
    """The run's config with the command line's overrides; problems become one-line usage errors."""
    from workbench.config.loader import ConfigError, load_config

    config_path = Path(ns.config)
    if not config_path.is_file():
        raise UsageError(f"{config_path}: no such config file; create one with 'workbench init {config_path}'")
    try:
        return load_config(config_path, ns.overrides)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _run(ns: argparse.Namespace) -> int:
    run = _load_run_config(ns)
    _join_world(run)
    _check_control(ns, run)
    # The model and the data are built and checked before anything is written into
    # output_dir: a broken data file or a bad argument leaves no folder behind.
    with _owned_output_dir(run, ns, prepare=lambda: _build_trainer(ns, run)) as (resume, trainer):
        return _train(ns, run, trainer, resume)


def _check_control(ns: argparse.Namespace, run) -> None:
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


def _build_trainer(ns: argparse.Namespace, run):
    """The run's Trainer (model, data, hooks); a problem in them is a one-line usage error."""
    from workbench.config.build import build_trainer
    from workbench.data.file_errors import DataFileError

    try:
        return build_trainer(run)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # a DataFileError names its file and line
        raise UsageError(str(exc) if isinstance(exc, DataFileError) else f"{ns.config}: {exc}") from None


def _train(ns: argparse.Namespace, run, trainer, resume: object) -> int:
    from workbench.config.loader import write_resolved_config
    from workbench.distributed.signals import install_stop_handlers

    output_dir = Path(run.training.output_dir)
    main_rank = trainer.is_world_process_zero()
    if main_rank:
        write_resolved_config(run, output_dir)
    if main_rank and not ns.headless and sys.stdout.isatty():
        return _run_dashboard(ns, trainer, resume, output_dir)
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
    restore = install_stop_handlers(_CurrentStop(current), [signal.SIGINT], on_repeat=abort)
    try:
        with HangupWatch(stop=lambda: _CurrentStop(current).set("SIGHUP")):
            if session is not None:
                session.run()
            else:
                trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        print("\nworkbench: interrupted", file=sys.stderr)
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
    if reason in ("SIGTERM", "SIGHUP"):
        say(f"workbench: stopped by {reason} at step {step}; checkpoint saved in {output_dir}", file=sys.stderr)
    elif reason == "SIGINT":
        say(f"workbench: interrupted at step {step}; checkpoint saved in {output_dir}", file=sys.stderr)
    elif reason == "session" and request.save:  # workbench ctl stop: as the quit dialog (saved: 0, not: 130)
        say(f"workbench: stopped at step {step}; checkpoint saved in {output_dir}", file=sys.stderr)
    elif reason == "session":
        say(f"workbench: stopped at step {step} without saving", file=sys.stderr)
    elif step < trainer.state.max_steps and _stopped_by_guard(trainer):
        count = len(trainer.workbench_state.guard["interventions"])
        stuck = (trainer.workbench_state.guard.get("progress") or {}).get("escalated")
        why = f"no progress: {stuck}; " if stuck else ""
        say(f"workbench: stopped by the guard at step {step} after {count} interventions ({why}guard events in "
            f"{output_dir / 'events.jsonl'}); checkpoint saved in {output_dir}", file=sys.stderr)
    else:
        say(f"workbench: finished; files in {output_dir}")
    return run_exit_code("stopped" if reason else "finished", reason, saved=request.save)


class _CurrentStop:
    """The stop request of the run this process trains now, for the signal handler (a remote
    branch replaces the run, and Ctrl-C must stop the branch)."""

    def __init__(self, current) -> None:
        self._current = current

    def set(self, reason: str, save: bool = True) -> bool:
        """Request a stop of the current run (False when one was already requested)."""
        return self._current().stop_request.set(reason, save)


def _stopped_by_guard(trainer) -> bool:
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


def _run_dashboard(ns: argparse.Namespace, trainer, resume: object, output_dir: Path) -> int:
    """The dashboard path: a Session trains in its thread while the app owns the terminal.

    The app returns an outcome; its exit code follows DESIGN.md (q then Enter saves and
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
    if outcome == "crashed":
        print(f"workbench: the dashboard failed; the run was stopped at step {step} and saved in {output_dir}",
              file=sys.stderr)
    elif outcome == "hangup":
        print(f"workbench: stopped by SIGHUP at step {step}; checkpoint saved in {output_dir}", file=sys.stderr)
    elif outcome in ("saved", "interrupted", "terminated"):
        print(f"workbench: stopped at step {step}; checkpoint saved in {output_dir}", file=sys.stderr)
    elif outcome in ("stopped", "aborted"):
        print(f"workbench: stopped at step {step} without saving", file=sys.stderr)
    else:
        print(f"workbench: {run.status}; files in {output_dir}")
    return OUTCOME_CODES.get(outcome, EXIT_FAILED)


def _attach(ns: argparse.Namespace) -> int:
    """The dashboard on a live run elsewhere; q detaches (the run goes on)."""
    from workbench.control.client import attach
    from workbench.control.discovery import NoLiveRun

    try:
        session = attach(ns.target, token=ns.token)
    except NoLiveRun as exc:
        print(f"workbench: {exc}", file=sys.stderr)
        return EXIT_NO_RUN
    except PermissionError as exc:
        raise UsageError(str(exc)) from None
    from workbench.widgets.tui import run_dashboard

    try:
        outcome = run_dashboard(session, handle_signals=False, attached=True)
    finally:
        session.close()
    if outcome == "detached":
        print(f"workbench: detached; the run goes on ({ns.target})")
        return EXIT_OK
    if outcome == "crashed":
        print(f"workbench: the dashboard failed (see above); the run goes on ({ns.target})", file=sys.stderr)
        return EXIT_FAILED
    note = session.end_note()
    if note:
        print(f"workbench: {note}")
    return OUTCOME_CODES.get(outcome, EXIT_OK)


def _watch(ns: argparse.Namespace) -> int:
    """A run read-only: live (attached, no steering) or from its files once it has ended."""
    from workbench.control.watch import open_watch

    try:
        session = open_watch(ns.output_dir)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise UsageError(str(exc)) from None
    from workbench.widgets.tui import run_dashboard

    try:
        outcome = run_dashboard(session, handle_signals=False, attached=True)
    finally:
        session.close()
    if outcome == "crashed":  # the watching failed, not the run
        print(f"workbench: watch failed (see above); the run is not affected ({ns.output_dir})", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
