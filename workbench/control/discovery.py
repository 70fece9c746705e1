"""Where a live run can be reached: ``output_dir/control.json`` and the runtime socket folder.

control.json (mode 0600) is written when a run's control server starts and removed when it
stops; it names the endpoint (a Unix socket path, or host and port with a token), the pid
and host of the run, the protocol version and the start time. A run killed with SIGKILL
leaves it behind: :func:`stale_reason` tells a client so (the pid is gone, or the socket is
missing), and the next run simply replaces the file.

Sockets live in a short per-user folder (``$XDG_RUNTIME_DIR/workbench`` or
``/tmp/workbench-<uid>``, mode 0700), not in output_dir: a Unix socket path must fit in
about 108 bytes, and output_dirs on clusters are often longer, or on filesystems (NFS,
Lustre) that cannot hold sockets at all. A run killed before it could remove its socket
leaves the file there; the next run to start removes it (its pid is gone and nothing answers
on it), never a live run's.
"""

from __future__ import annotations

from workbench.core.names import CONTROL_FILE

import json
import os
import re
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

from workbench.checkpoint.lock import pid_alive

__all__ = ["CONTROL_FILE", "SUN_PATH_MAX", "NoLiveRun", "runtime_dir", "socket_path", "write_control",
           "read_control", "remove_stale_sockets", "remove_control", "stale_reason", "pid_alive", "check_socket_owner"]

SUN_PATH_MAX = 107  # bytes usable in sockaddr_un.sun_path on Linux (108 with the NUL)


class NoLiveRun(RuntimeError):
    """No live run answers at a target (no control.json, a stale one, or nothing listening)."""


def runtime_dir() -> Path:
    """The per-user folder for control sockets, created with mode 0700 (only its owner can
    connect: that is the Unix transport's access control)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "workbench" if xdg and Path(xdg).is_dir() else Path(tempfile.gettempdir()) / f"workbench-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = base.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{base} is not a folder owned by this user; refusing to put control sockets there")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(base, 0o700)
    return base


_SOCKET_NAME = re.compile(r"^(\d+)-[0-9a-f]+\.sock$")  # "<pid>-<random hex>.sock", as the server names them


def remove_stale_sockets(folder: Path) -> list[str]:
    """Remove the sockets in ``folder`` that runs killed before they could (SIGKILL, OOM)
    left behind: those whose pid is gone and where nothing answers. A live run's socket is
    never touched (its pid exists); returns the names removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _SOCKET_NAME.match(entry.name)
        if not match or pid_alive(int(match.group(1))):
            continue
        try:
            if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode) or _answers(entry.path):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.name)
    return removed


def _answers(path: str) -> bool:
    """Whether something listens on the Unix socket ``path`` (a run in another pid namespace)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def socket_path(name: str) -> Path:
    """A socket path in the runtime folder; ValueError when it would not fit in sun_path.
    Sockets left there by killed runs are removed first (:func:`remove_stale_sockets`)."""
    folder = runtime_dir()
    remove_stale_sockets(folder)
    path = folder / name
    if len(os.fsencode(str(path))) > SUN_PATH_MAX:
        raise ValueError(f"control socket path {path} is longer than {SUN_PATH_MAX} bytes; set XDG_RUNTIME_DIR "
                         "to a shorter folder or use --control-port")
    return path


def check_socket_owner(path: str | os.PathLike) -> None:
    """Refuse a Unix socket another user owns (PermissionError, one line).

    control.json sits in an output_dir that others may write to (a shared project folder):
    a socket planted there by someone else would receive this user's commands and could
    answer them with anything. The run's own socket is always its owner's (runtime_dir)."""
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return  # nothing to connect to: the connection attempt says so
    if owner != os.getuid():
        raise PermissionError(f"control socket {path} is owned by uid {owner}, not by this user (uid "
                              f"{os.getuid()}); refusing to connect")


def write_control(output_dir: str | os.PathLike, info: dict[str, Any]) -> Path:
    """Write control.json atomically with mode 0600 (it may hold a TCP token), replacing any
    stale one."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / CONTROL_FILE
    tmp = folder / f".{CONTROL_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask; the token must not be readable
        os.write(fd, (json.dumps(info, indent=1) + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    return target


def read_control(output_dir: str | os.PathLike) -> dict[str, Any]:
    """control.json of a run; NoLiveRun (one line) when there is none or it is unreadable."""
    path = Path(output_dir) / CONTROL_FILE
    if not Path(output_dir).is_dir():
        raise NoLiveRun(f"{output_dir} is not a directory; pass a run's output_dir or HOST:PORT")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NoLiveRun(f"no live run in {output_dir} (no {CONTROL_FILE}: the run has ended, has not started, "
                        "or runs with --no-control)") from None
    except (OSError, ValueError) as exc:
        raise NoLiveRun(f"{path} is unreadable ({exc})") from None
    if not isinstance(info, dict):
        raise NoLiveRun(f"{path} is not a control file")
    return info


def remove_control(output_dir: str | os.PathLike, pid: int | None = None,
                   endpoint: dict[str, Any] | None = None) -> None:
    """Remove control.json, but only this process's (a newer run may have replaced it), and
    with ``endpoint`` only if it still names that endpoint (a newer Session of this process
    may serve the same output_dir)."""
    path = Path(output_dir) / CONTROL_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if pid is not None and info.get("pid") != pid:
        return
    if endpoint is not None and any(info.get(k) != endpoint.get(k) for k in ("socket", "tcp", "started")):
        return
    try:
        path.unlink(missing_ok=True)
    except OSError:
        # A folder gone read-only under the run: the file stays, and clients see it is stale
        # (its pid is gone); whatever ended the run is the news, not this.
        pass


def stale_reason(info: dict[str, Any]) -> str | None:
    """Why a control.json was left by a run that is gone, or None if it may be live. Only
    decidable on the run's own host (elsewhere a connection attempt decides)."""
    if info.get("host") != socket.gethostname():
        return None
    if not pid_alive(info.get("pid")):
        return f"the run (pid {info.get('pid')}) is gone; its {CONTROL_FILE} is stale"
    path = info.get("socket")
    if path and not Path(path).exists():
        return f"its socket {path} is missing; the {CONTROL_FILE} is stale"
    return None
