"""The output_dir of ``workbench run``: what to resume from, what --overwrite clears, and
the lock that keeps one run per folder, all checked before anything is written (a refusal
is one line, and nothing saved is lost or overwritten)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.cli.usage import UsageError

if TYPE_CHECKING:
    from workbench.checkpoint.lock import OutputDirLock

__all__ = ["plan_output_dir", "check_resume_path", "claim_output_dir", "owned_output_dir", "clear_checkpoints"]


def plan_output_dir(output_dir: Path, resume: object, overwrite: bool) -> tuple[object, bool]:
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
        check_resume_path(path)
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


def check_resume_path(path: Path) -> None:
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


def claim_output_dir(output_dir: Path) -> "OutputDirLock | None":
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
def owned_output_dir(run, ns: argparse.Namespace, prepare=None) -> Iterator[tuple[object, object]]:
    """Check the output_dir and ``--resume`` (nothing created on a refusal), run ``prepare``
    (building the Trainer: model and data, all checked) while nothing is written yet, then
    hold the folder's lock for the block; yields (resume_from_checkpoint, prepare's result)."""
    from workbench.checkpoint.lock import OutputDirBusy, check_not_busy, check_writable
    from workbench.core.world import is_main_process

    output_dir = Path(run.training.output_dir)
    if is_main_process():  # the others' folder is rank 0's: it has the lock
        try:
            # A live run's folder is said as such first: its checkpoints are that run's, and
            # --resume or --overwrite would be refused the same way (issue 29).
            check_not_busy(output_dir)
        except OutputDirBusy as exc:
            raise UsageError(str(exc)) from None
    resume, clear = plan_output_dir(output_dir, ns.resume, ns.overwrite)
    if prepare is not None:
        try:
            check_writable(output_dir, create=False)
        except OSError as exc:
            raise UsageError(f"training.{exc}") from None
    prepared = prepare() if prepare is not None else None
    lock = claim_output_dir(output_dir)
    try:
        if clear:
            clear_checkpoints(output_dir)
        yield resume, prepared
    finally:
        if lock is not None:
            lock.release()


def clear_checkpoints(output_dir: Path) -> None:
    """--overwrite: delete the old checkpoints and event log (rank 0, under the lock)."""
    from workbench.checkpoint.store import CheckpointStore
    from workbench.core.world import is_main_process

    if not is_main_process():
        return
    deleted = []
    for info in CheckpointStore(output_dir).list():
        shutil.rmtree(info.path, ignore_errors=True)
        deleted.append(info.name)
    events = output_dir / "events.jsonl"
    if events.exists():
        events.unlink(missing_ok=True)
        deleted.append(events.name)
    if deleted:  # said, so a mistyped --overwrite is noticed while the cause is on screen
        shown = ", ".join(deleted[:6]) + (f" and {len(deleted) - 6} more" if len(deleted) > 6 else "")
        print(f"workbench: --overwrite deleted from {output_dir}: {shown}", file=sys.stderr)


