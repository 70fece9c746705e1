"""What went wrong when a checkpoint could not be written, in words a user can act on.

A full disk shows up in many disguises: ``OSError(ENOSPC)`` from Python's own writes,
safetensors' ``IoError(Os { code: 28, .. })``, and torch.save's
``[enforce fail at inline_container.cc:672] . unexpected pos`` (its C++ writer drops the
errno). This module finds the cause (the errno where one survives; else the free space and
the file-size limit, measured right after the failure) and :class:`CheckpointWriteError`
says it in one line: which checkpoint, which folder, how large it is, how much is free.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

__all__ = ["CheckpointWriteError", "STORAGE_ERRNOS", "classify", "describe", "human_size", "is_storage_failure",
           "same_storage_failure", "storage_errno", "write_error"]

# The errors a user fixes on the storage side (free space, permissions, quota), not in code.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EIO}
_LOW_SPACE = 1 << 20  # this little free space after a failed write: the disk was full

_WORDS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the folder is read-only (read-only file system)",
    errno.EACCES: "the folder is not writable (permission denied)",
    errno.EPERM: "the folder is not writable (operation not permitted)",
    errno.EIO: "input/output error (a failing device or network filesystem?)",
}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota, a read-only folder); the
    partial folder is removed where it can be, and the checkpoints published before are
    untouched. ``str()`` is the one line to show; ``errno`` the cause, where known."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.errno = code


def human_size(n: float) -> str:
    """Bytes as ``612 B``, ``3.4 KB``, ``1.2 GB`` (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _torch_writer_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        tag in text for tag in ("inline_container", "PytorchStreamWriter", "file write failed"))


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_errno(exc: BaseException) -> int | None:
    """The errno of a storage failure anywhere in ``exc``'s chain (safetensors' text too)."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno is not None:
            return link.errno
        match = re.search(r"(?:code: |os error )(\d+)", str(link)) if type(link).__name__ == "SafetensorError" else None
        if match:
            return int(match.group(1))
    return None


def is_storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the storage failing a write (not a bug in what was written)."""
    return any(isinstance(link, OSError) or type(link).__name__ == "SafetensorError" or _torch_writer_failure(link)
               for link in _chain(exc))


def same_storage_failure(error: BaseException, later: BaseException) -> bool:
    """Whether ``later`` (say, writing the error record) failed on the storage as ``error``
    did: then it is the same news, and saying it twice helps no one."""
    return is_storage_failure(error) and isinstance(later, OSError) and later.errno in STORAGE_ERRNOS


def _free_bytes(folder: Path) -> int | None:
    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _file_size_limit() -> int | None:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _read_only(folder: Path) -> bool:
    for candidate in (folder, *folder.parents):
        try:
            return bool(os.statvfs(candidate).f_flag & os.ST_RDONLY)
        except OSError:
            continue
    return False


def classify(exc: BaseException, folder: Path, needed: int | None = None) -> int | None:
    """The errno behind a failed write into ``folder`` (None: unknown). Call it before the
    partial files are removed, so a full disk still measures as full."""
    code = storage_errno(exc)
    if code is not None:
        return code
    free = _free_bytes(folder)  # torch's writer says only "unexpected pos": measure instead
    if free is not None and (free < _LOW_SPACE or (needed is not None and free < needed)):
        return errno.ENOSPC
    if _file_size_limit() is not None:
        return errno.EFBIG
    return errno.EROFS if _read_only(folder) else None


def describe(code: int | None, exc: BaseException, folder: Path, needed: int | None = None) -> str:
    """What went wrong, in words: the cause, and for a full disk or quota the checkpoint's
    size and the space free in ``folder`` now (after the partial files went)."""
    if code == errno.EFBIG:
        limit = _file_size_limit()
        return "a file is over the file-size limit" + (f" (ulimit -f: {human_size(limit)})" if limit else "") \
            + ": file too large"
    if code not in _WORDS:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return f"a write failed ({type(exc).__name__}: {first.strip()})"
    words = _WORDS[code]
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(folder)
        parts = [f"the checkpoint needs about {human_size(needed)}" if needed else None,
                 f"{human_size(free)} free there" if free is not None else None]
        if any(parts):
            words += f" ({', '.join(p for p in parts if p)})"
    return words


def write_error(name: str, folder: Path, partial: Path, exc: BaseException, code: int | None,
                needed: int | None = None, earlier: list[str] | None = None) -> CheckpointWriteError:
    """The one-line error for checkpoint ``name`` that could not be written into ``folder``
    (``partial``: its temporary folder, removed already if it could be; ``earlier``: the
    checkpoints published there before, which nothing touched)."""
    cause = describe(code, exc, folder, needed)
    left = (f"no partial {partial.name} is left" if not partial.exists()
            else f"the partial {partial.name} could not be removed (it is never resumed from)")
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = "free some space (or lower save_total_limit), then resume with --resume"
    elif code == errno.EFBIG:
        hint = "raise the file-size limit (ulimit -f), then resume with --resume"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = "make the folder writable, then resume with --resume"
    else:
        hint = "resume with --resume once the storage works again"
    if earlier:
        kept = f"{', '.join(earlier[-3:])}{' and older ones' if len(earlier) > 3 else ''} intact"
    else:
        kept = "no checkpoint was saved before"
    return CheckpointWriteError(f"saving {name} into {folder} failed: {cause}; {left}, {kept}; {hint}", code)
