"""What a Session does with its run's checkpoints: list and delete them, resume from one,
branch from one, and restart a live run in place (what a remote ``checkpoints resume_from``
or ``branch`` asks for).

A mixin of :class:`workbench.session.local.Session`, kept apart because it is one concern
with its own rules: a checkpoint must be complete, a branch gets its own empty folder and
valid overrides (session/branching.py), the best and newest checkpoints are never deleted,
and a live run is stopped first, in its own thread, before it restarts from the checkpoint.
It uses the Session's lock, status and worker loop (``_looping``, ``_followup``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from workbench.checkpoint.store import CheckpointStore
from workbench.door.values import ENDED, CheckpointRow, SeriesStore, Status

__all__ = ["CheckpointCommands"]

Session = Any  # annotations only: local.py's Session is made of this mixin, so it is not imported back


class CheckpointCommands:
    """Checkpoint commands of a Session (list, delete, resume_from, branch, restarts in place)."""

    def resume_from(self, checkpoint: str | Path, *, other_run: bool = False, **overrides: Any) -> "Session":
        """Restart this session's run from a catalog checkpoint. A live run is stopped first,
        without saving (what it did since ``checkpoint`` is dropped), and restarts in its own
        thread; this returns once it has (as a remote ``resume_from`` does).

        ``checkpoint`` is a name in this run's output_dir (``"checkpoint-40"``) or a path
        there; another run's checkpoint only with ``other_run=True``. It must verify and its
        weights must fit this model: everything is checked before the live run stops.

        ``overrides`` change the run's arguments first (those train/resume_args.py COMPARED
        lists, e.g. save_steps=3); the resume warns about each one that differs from the
        checkpoint's and applies the live-editable ones from the resume step, recorded.
        """
        if self._live():
            self.restart_from(checkpoint, other_run=other_run, **overrides).result()
            return self
        self._require_not_running("resume_from")
        self._prepare_resume(self._usable_checkpoint(checkpoint, "resume_from", other_run), overrides)
        return self.start()

    def _prepare_resume(self, checkpoint: Path, overrides: dict[str, Any]) -> None:
        if overrides:
            from workbench.train.resume_args import replace_arguments

            replace_arguments(self.trainer, **overrides)
        self._resume = str(checkpoint)
        self._series = SeriesStore()
        self._emit("resume_from", checkpoint=str(checkpoint))

    def restart_from(self, checkpoint: str | Path, *, other_run: bool = False, **overrides: Any) -> Future:
        """resume_from() for a run that may still be going (what a remote ``checkpoints
        resume_from`` does): a live run is stopped without saving (its progress since
        ``checkpoint`` is dropped) and restarts from ``checkpoint`` where it ran, in the same
        thread (run(): the caller's) and with the same endpoint; an ended run restarts at once.

        Checked before anything stops, as resume_from() checks: a checkpoint of this run
        (unless ``other_run``) that verifies and fits the model, overrides that a resume can
        change (train/resume_args.py). Returns a Future that resolves to the status once the
        new run has started."""
        from workbench.session.branching import check_resume_overrides

        self._require_main("resume_from")
        self._require_single("resume_from")
        checkpoint = self._usable_checkpoint(checkpoint, "resume_from", other_run)
        overrides = check_resume_overrides(self.trainer.args, overrides)

        def restart() -> Status:
            with self._lock:
                self._error = self._traceback = None
                self._prepare_resume(checkpoint, overrides)
                self._set_status(Status.RUNNING)
            return self._status

        return self._after_run("resume_from", restart, save=False,
                               now=lambda: self.resume_from(checkpoint, other_run=True, **overrides).status)

    def branch_from(self, checkpoint: str | Path, output_dir: str | Path, save: bool = True, *,
                    other_run: bool = False, **overrides: Any) -> Future:
        """branch() for a run that may still be going (what a remote ``checkpoints branch``
        does): a live run is stopped (with a checkpoint unless ``save=False``, so it can be
        resumed later), then the branch starts as a new run in this process, serving its own
        endpoint in ``output_dir``; it is this Session's ``successor``. Under run() it trains
        in the caller's thread once this run's endpoint has closed; under start() in a thread
        of its own, while this Session keeps serving its ended run.

        Everything check_branch() refuses is refused first, before anything stops. Returns a
        Future that resolves to the branch's Session once its endpoint serves."""
        self._require_main("branch")
        self._require_single("branch")
        if not self.branches_here:
            raise RuntimeError("branch: this run is a Trainer.train() call, which trains its own Trainer only; "
                               "branch from a Session or a workbench run, or resume_from here")
        checkpoint = self._usable_checkpoint(checkpoint, "branch", other_run)
        overrides = self.check_branch(checkpoint, output_dir, other_run=True, **overrides)

        def start_branch() -> "Session":
            child = self._new_branch(checkpoint, output_dir, overrides)
            self.successor = child
            if self._in_caller:
                child._start_control()  # serving before this run's endpoint closes; trained by run()
            else:
                child.start()
            return child

        return self._after_run("branch", start_branch, save=save, now=start_branch)

    def _after_run(self, what: str, action: Any, save: bool, now: Any) -> Future:
        """Run ``action`` once the current run has ended: a live run is stopped and its worker
        runs it; an ended (or not started) run runs ``now`` in this thread."""
        future: Future = Future()
        with self._lock:
            if self._followup is not None:
                raise RuntimeError(f"{what}: a resume_from or branch is already under way; wait for it")
            if self._looping:
                self._followup = (action, future)
                if self._status not in ENDED:
                    self.stop(save=save, reason=what)  # its end says why: to resume from / branch from a checkpoint
                return future
            if self._in_caller:
                raise RuntimeError(f"{what}: this run has ended and its process is exiting; start it again "
                                   "with workbench run --resume CHECKPOINT")
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # the ended worker is on its way out
        try:
            future.set_result(now())
        except Exception as exc:  # noqa: BLE001 - reported to the caller through the Future
            future.set_exception(exc)
        return future

    def parse_overrides(self, text: str | Mapping[str, str]) -> dict[str, Any]:
        """Overrides as typed, for check_branch() and branch(): ``"warmup_steps=10,
        lr_scheduler_type=linear"``, or ``{"learning_rate": "1e-3"}`` from form fields (empty
        ones left out). Values are read as TOML, as ``--set`` reads them. Raises ValueError
        with one line on a pair without ``=``."""
        from workbench.config.loader import parse_overrides

        overrides = parse_overrides(text)
        if "output_dir" in overrides:  # branch(checkpoint, output_dir, **overrides) could not take it
            raise ValueError("output_dir: the branch's folder is its own argument (the output dir field), "
                             "not an override")
        return overrides

    def check_branch(self, checkpoint: str | Path, output_dir: str | Path, *, other_run: bool = False,
                     **overrides: Any) -> dict[str, Any]:
        """Everything branch() checks, without stopping or creating anything; returns the
        overrides validated (session/branching.py says what is refused). Callable while the
        run goes on, so a form can refuse a typo before the run is stopped for the branch.
        ``checkpoint`` is resolved as resume_from() resolves it."""
        from workbench.session.branching import check_branch

        path = self._usable_checkpoint(checkpoint, "branch", other_run)
        step = next(c.step for c in CheckpointStore(path.parent).list() if c.name == path.name)
        return check_branch(self.trainer.args, step, output_dir, overrides)

    def branch(self, checkpoint: str | Path, output_dir: str | Path, save: bool = True, *,
               other_run: bool = False, **overrides: Any) -> "Session":
        """A new Session that starts from ``checkpoint`` into ``output_dir`` with changed arguments.

        From an ended run it is returned not started. A live run is stopped first (with a
        checkpoint unless ``save=False``) and the branch is returned started (as a remote
        ``branch`` does). Everything check_branch() refuses is refused first."""
        if self._live():
            return self.branch_from(checkpoint, output_dir, save=save, other_run=other_run, **overrides).result()
        self._require_not_running("branch")
        checkpoint = self._usable_checkpoint(checkpoint, "branch", other_run)
        overrides = self.check_branch(checkpoint, output_dir, other_run=True, **overrides)
        return self._new_branch(checkpoint, output_dir, overrides)

    def _new_branch(self, checkpoint: str | Path, output_dir: str | Path, overrides: dict[str, Any]) -> "Session":
        from workbench.session.branching import branch_trainer

        trainer, origin = branch_trainer(self.trainer, checkpoint, output_dir, overrides)
        # The checkpoint restores the optimizer/schedule (old learning rate) and the state's
        # intervals; the resume applies the overrides that differ after the restore, as
        # recorded live edits (train/resume_args.py). The branch serves as this run does:
        # over TCP on a free port of its own (this run's may still be bound).
        child = type(self)(trainer, resume_from_checkpoint=str(checkpoint), origin=origin, control=self.control,
                           control_port=0 if self.control_port is not None else None, control_host=self.control_host)
        child.pauses_for_guard = self.pauses_for_guard  # a headless run's branch stops on the guard too
        return child

    def _usable_checkpoint(self, checkpoint: str | Path, what: str, other_run: bool = False) -> Path:
        """The folder ``checkpoint`` names, once it is sure a restart or branch can use it:
        a name resolves in this run's output_dir; a path must be there too unless
        ``other_run``; it is complete, every file matches its manifest (hashes), and its
        weights fit this model (names and shapes). ValueError with one line otherwise, before
        anything stops (a remote client's bad target must leave the live run untouched)."""
        from workbench.checkpoint.trainer_state import weights_misfit
        from workbench.core.trainer_utils import unwrap_model

        own = CheckpointStore(self.trainer.args.output_dir)
        text = str(checkpoint).strip()
        if not text:
            raise ValueError(f"{what}: expected a checkpoint name such as checkpoint-40 (see checkpoints)")
        try:
            path = own.named(text)
        except LookupError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if not other_run and path.resolve().parent != own.root.resolve():
            raise ValueError(f"{what}: {checkpoint} is not a checkpoint of this run ({own.root}); name one of its "
                             "checkpoints (see checkpoints), or allow another run's with other_run=True")
        store = CheckpointStore(path.parent)
        info = next((c for c in store.list() if c.name == path.name), None)
        if info is None:
            raise ValueError(f"{what}: {checkpoint} is not a checkpoint (expected a checkpoint-STEP folder, "
                             f"as 'workbench checkpoints {own.root}' lists them)")
        if not info.complete:
            raise ValueError(f"{what}: {info.name} is incomplete ({info.problem or 'no manifest'}); "
                             "pick a complete checkpoint")
        problem = store.problem(path)
        if problem is None:
            problem = weights_misfit(unwrap_model(self.trainer.model), path)
        if problem is not None:
            raise ValueError(f"{what}: {info.name} cannot be used: {problem}; pick another checkpoint")
        return path

    def _live(self) -> bool:
        """Whether a run of this Session's worker is under way (resume_from / branch then stop it)."""
        with self._lock:
            return self._looping and not self._in_caller

    @property
    def checkpoints(self) -> list[CheckpointRow]:
        """The checkpoint catalog of this run's output_dir, oldest first (same rows as the dashboard)."""
        return CheckpointStore(self.trainer.args.output_dir).list()

    def delete_checkpoint(self, name: str) -> None:
        """Delete one checkpoint of this run's output_dir by name (``"checkpoint-40"``).

        Refused with a one-line ValueError: the best and the newest complete checkpoint (the
        store's ``protected`` flag: load_best_model_at_end and a resume need them), and the
        checkpoint this run resumes from until the run has ended.
        """
        self._require_main("delete_checkpoint")
        name = str(name)
        store = CheckpointStore(self.trainer.args.output_dir)
        # These lines reach ctl and the dashboard too: they name the command that lists the
        # checkpoints, not the Python property.
        if not name or Path(name).name != name:
            raise ValueError(f"delete_checkpoint: expected a checkpoint name such as checkpoint-40 "
                             f"(see 'workbench checkpoints {store.root}'), got {name!r}")
        info = next((c for c in store.list() if c.name == name), None)
        if info is None:
            raise ValueError(f"delete_checkpoint: no {name} in {store.root} (see 'workbench checkpoints "
                             f"{store.root}')")
        if info.protected:
            why = "the best checkpoint" if info.best else "the newest complete checkpoint"
            raise ValueError(f"delete_checkpoint: {name} is protected ({why}); delete an older one")
        resumes = isinstance(self._resume, (str, Path)) and Path(self._resume).resolve() == Path(info.path).resolve()
        if resumes and self._status not in ENDED:
            raise ValueError(f"delete_checkpoint: {name} is in use: this run resumes from it (delete it once the "
                             "run has ended)")
        store.delete(name)
        self._refresh_catalog()
        self._log_event("delete", checkpoint=name)
        self._emit("deleted", checkpoint=name)
        self._publish()
