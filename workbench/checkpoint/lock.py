"""One writer per output_dir: rank 0 of a run holds ``output_dir/.lock``.

The lock is an ``flock`` on the file, so the kernel releases it when its process dies,
however it dies; the file's text (pid, host, start time) names the holder for the error a
second run prints. A lock file whose ``flock`` is free but whose text names another
process was left by a killed run: it is taken over, and the takeover is logged.

``workbench run --num-processes N`` takes the lock in the parent and hands it to its
ranks through ``WORKBENCH_LOCK_OWNER`` (rank 0 sees its own launcher as the holder).
Within one process the CLI's lock is re-entrant for the one Trainer it runs; any other
Trainer training into the same folder at the same time is refused like another process.
"""

from __future__ import annotations

from workbench.core.names import LOCK_NAME

import errno
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_NAME", "OWNER_ENV", "OutputDirBusy", "OutputDirLock", "hold_output_dir", "check_not_busy",
           "check_writable", "pid_alive", "release_held"]

log = logging.getLogger("workbench")

OWNER_ENV = "WORKBENCH_LOCK_OWNER"

_HELD: dict[str, "OutputDirLock"] = {}  # re-entrant locks of this process, by folder
_SHARED: dict[str, int] = {}  # holders in this process of a lock hold_output_dir took
_SHARING = threading.Lock()  # Sessions train in threads


class OutputDirBusy(RuntimeError):
    """Another live run writes to this output_dir (one line naming it)."""


def _holder_text(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}"


def _busy_text(root: Path, holder: dict) -> str:
    return (f"{root} is in use by another run ({_holder_text(holder)}); wait for it to finish, stop it, "
            "or choose another output_dir")


def _held_by_launcher(holder: dict) -> bool:
    """Whether the holder is this rank's own launcher (``workbench run --num-processes``)."""
    owner = os.environ.get(OWNER_ENV)
    return bool(owner) and str(holder.get("pid")) == owner and holder.get("host") == socket.gethostname()


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 65536)
        data = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def pid_alive(pid: object) -> bool:
    """Whether a process with this pid exists on this host (one another user owns counts)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputDirLock:
    """The lock on one output_dir; :meth:`acquire` raises :class:`OutputDirBusy` when taken."""

    def __init__(self, output_dir: str | os.PathLike, reentrant: bool = False) -> None:
        self.root = Path(output_dir)
        self.path = self.root / LOCK_NAME
        self.reentrant = reentrant
        self.inherited = False  # held by this rank's launcher, not by this process
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None or self.inherited

    def acquire(self) -> str | None:
        """Take the lock (the folder must exist). Returns the takeover message when a stale lock
        was replaced, else None."""
        import fcntl

        for _ in range(10):  # retried only when a holder removed the file as we opened it
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                if _held_by_launcher(holder):
                    self.inherited = True
                    self._register()
                    return None
                raise OutputDirBusy(_busy_text(self.root, holder)) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                return self._acquire_without_flock(fd)
            try:
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            return self._claim(fd)
        raise OutputDirBusy(f"{self.path}: could not take the lock (it keeps changing); try again")

    def _acquire_without_flock(self, fd: int) -> str | None:
        # A filesystem without locks: the pid decides, where it can be checked (same host).
        holder = _read(fd)
        if holder and holder.get("host") == socket.gethostname() and pid_alive(holder.get("pid")) \
                and holder.get("pid") != os.getpid():
            os.close(fd)
            raise OutputDirBusy(_busy_text(self.root, holder))
        return self._claim(fd)

    def _claim(self, fd: int) -> str | None:
        previous = _read(fd)
        message = None
        if previous.get("pid") is not None:
            message = (f"{self.root}: took over a stale lock ({_holder_text(previous)}); "
                       "that run is gone and did not release it")
            log.warning("%s", message)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "argv": sys.argv[:8]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))
        os.fsync(fd)
        self._fd = fd
        self._register()
        return message

    def _register(self) -> None:
        if self.reentrant:
            _HELD[str(self.root.resolve())] = self

    def release(self) -> None:
        """Remove the lock file and unlock (the file goes first, so no one locks a dead inode)."""
        if _HELD.get(str(self.root.resolve())) is self:
            del _HELD[str(self.root.resolve())]
        self.inherited = False
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            # A folder gone read-only (or removed) under the run: the flock still ends with the
            # fd, the next run takes the file over, and whatever ended this run is the news.
            log.debug("could not remove %s: %s", self.path, exc)
        finally:
            os.close(self._fd)
            self._fd = None


def release_held(output_dir: str | os.PathLike) -> None:
    """Release this process's lock on ``output_dir`` (the CLI's), if it holds one: for a
    process about to leave without unwinding (a closed terminal, hangup.py)."""
    lock = _HELD.get(str(Path(output_dir).resolve()))
    if lock is not None:
        lock.release()


def check_not_busy(output_dir: str | os.PathLike) -> None:
    """Raise :class:`OutputDirBusy` when a live run holds ``output_dir``'s lock; creates and
    changes nothing. A look before slow work (building the model, loading data): the lock
    itself is taken afterwards, by :meth:`OutputDirLock.acquire`, which decides for good."""
    import fcntl

    root = Path(output_dir)
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return  # no lock file (no run, or none yet): nothing holds the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a holder has it exclusively
    except BlockingIOError:
        holder = _read(fd)
        if not _held_by_launcher(holder):
            raise OutputDirBusy(_busy_text(root, holder)) from None
    except OSError:
        pass  # a filesystem without locks: acquire() decides by the pid
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def hold_output_dir(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold the output_dir's lock for a block (a Trainer's train()).

    The lock keeps other processes out. Within this process it is shared: the CLI's lock
    covers the Trainer it runs, and a second Trainer here (a notebook cell run again while
    its Session trains) shares it too, as it did before locks existed; it is released
    when the last holder here is done.
    """
    root = Path(output_dir)
    key = str(root.resolve())
    with _SHARING:
        cli_held = key in _HELD and key not in _SHARED  # the CLI's lock: it releases it
        if not cli_held:
            if key not in _HELD:
                check_writable(root)  # a read-only folder is said in one line, not by the lock's open()
                OutputDirLock(root, reentrant=True).acquire()
                _SHARED[key] = 0
            _SHARED[key] += 1
    try:
        yield
    finally:
        if not cli_held:
            with _SHARING:
                _SHARED[key] -= 1
                if _SHARED[key] == 0:  # the last holder here releases it
                    del _SHARED[key]
                    _HELD[key].release()


def check_writable(path: str | os.PathLike, create: bool = True) -> None:
    """Create ``path`` and write a probe file there: a run fails before training, with a line
    saying why, when its output_dir cannot hold the event log and checkpoints.

    ``create=False`` leaves a missing folder uncreated and asks its nearest existing parent
    instead (a check before any work, which must leave nothing behind)."""
    folder = Path(path)
    if not create and not folder.exists():
        parent = next((p for p in folder.absolute().parents if p.exists()), None)
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            import errno

            reason = os.strerror(errno.EROFS if _read_only_mount(parent) else errno.EACCES)
            raise OSError(f"output_dir: cannot create {folder} in {parent} ({reason}); choose a writable folder")
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"  # per process: ranks probe at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"output_dir: cannot write to {folder} ({exc.strerror or exc}); choose a writable folder") from exc


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
