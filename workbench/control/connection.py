"""One connection to a run's control endpoint: the request/reply and event-stream plumbing
under ``RemoteSession`` (client.py), with the errors a connection raises and how a target
(an output_dir, ``HOST:PORT``) resolves to where the run listens."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from workbench.control.discovery import NoLiveRun, check_socket_owner, read_control, stale_reason
from workbench.control.protocol import (
    MAX_LINE, PROTOCOL_VERSION, ProtocolError, decode_reply, encode, event_from_dict)
from workbench.door.values import SessionEvent

__all__ = ["Connection", "RemoteError", "Refused", "Dropped", "Unanswered", "SLOW", "resolve_target"]

_ERRORS = {"ValueError": ValueError, "KeyError": ValueError, "TypeError": ValueError, "TimeoutError": TimeoutError,
           "PermissionError": PermissionError}


class RemoteError(RuntimeError):
    """The server refused the message itself (protocol error, internal error)."""


class Refused(NoLiveRun):
    """The run is there but takes no connection now (every slot is in the middle of a command)."""


class Dropped(NoLiveRun):
    """The run closed this connection, and said why (idle too long, a slot needed, a deadline)."""


class _Hangup(NoLiveRun):
    """The connection closed without a word (the run ended, or closed it before reading a request)."""


_IDLE_DEFAULT = 300.0  # what a server that does not say (hello's idle_timeout) is assumed to allow


def resolve_target(target: str | Path) -> dict[str, Any]:
    """How to reach ``target``: control.json of an output_dir, or ``HOST:PORT`` (token from
    ``--token`` / the caller). NoLiveRun when an output_dir has no live run."""
    text = str(target)
    path = Path(text)
    if not path.exists() and ":" in text and not text.startswith(("/", ".")):
        host, _, port = text.rpartition(":")
        if port.isdigit():
            return {"tcp": f"{host.strip('[]')}:{port}", "token": None}
    info = read_control(path)
    why = stale_reason(info)
    if why:
        raise NoLiveRun(f"no live run in {target}: {why}")
    return info


class Unanswered(NoLiveRun):
    """The run took the connection but did not say hello within the timeout: busy or frozen,
    not gone (to a new client it is no live run; to one already attached, a slow one)."""


# What a late answer raises: the run is slow, not ended.
SLOW = (TimeoutError, Unanswered)


class Connection:
    """One socket to the server: request, reply; or a stream of events once subscribed."""

    def __init__(self, info: Mapping[str, Any], token: str | None = None, timeout: float = 5.0,
                 client: str = "remote") -> None:
        self._ids = itertools.count(1)
        self._buffer = bytearray()
        self.timeout = timeout
        try:
            if info.get("socket"):
                check_socket_owner(info["socket"])  # PermissionError: not an OSError we report as "no run"
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(str(info["socket"]))
            else:
                host, _, port = str(info["tcp"]).rpartition(":")
                self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        except PermissionError:
            raise
        except OSError as exc:
            where = info.get("socket") or info.get("tcp")
            raise NoLiveRun(f"no live run answers at {where} ({exc.strerror or exc})") from None
        where = info.get("socket") or info.get("tcp")
        try:
            # ``client`` names who connects (ctl, attach, remote): the run's console and the
            # stop reason of a stop asked here say it (door/endings.py).
            self.hello = self.call("hello", token=token or info.get("token"), client=client)
        except PermissionError:  # a wrong token: said as it is
            self.close()
            raise
        except NoLiveRun as exc:  # Refused, Dropped, a hang-up: the run is there but took no connection
            self.close()
            raise type(exc)(f"the run at {where} refused the connection: {exc}") from None
        except (OSError, ProtocolError, RemoteError) as exc:
            self.close()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            raise (Unanswered if isinstance(exc, TimeoutError) else NoLiveRun)(
                f"the run at {where} did not answer ({why})") from None
        self.idle_timeout = float(self.hello.get("idle_timeout") or _IDLE_DEFAULT)
        self.used = time.monotonic()
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            self.close()
            raise RemoteError(f"the run speaks control protocol {self.hello.get('protocol')}, this client "
                              f"{PROTOCOL_VERSION}; use the same workbench version on both sides")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _line(self, timeout: float | None) -> bytes:
        self.sock.settimeout(timeout)
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE:
                raise ProtocolError("reply over the line limit")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise _Hangup("the run closed the connection (it has ended, or refused the message)")
            self._buffer += chunk
        line, self._buffer = bytes(self._buffer[:end]), self._buffer[end + 1:]
        return line

    def call(self, cmd: str, _wait: float | None = None, **args: Any) -> Any:
        """Send one request and return its result; the server's error as the same exception type."""
        ident = next(self._ids)
        self.used = time.monotonic()
        self.sock.settimeout(self.timeout)
        try:
            self.sock.sendall(encode({"id": ident, "cmd": cmd, "args": args}))
        except (BrokenPipeError, ConnectionResetError):
            self._parting_words()
            raise
        while True:
            reply = decode_reply(self._line(_wait or self.timeout))
            if "event" in reply:  # a subscribed connection interleaves events; requests there are rare
                continue
            break
        self.used = time.monotonic()
        if reply.get("ok"):
            return reply.get("result")
        error, kind = str(reply.get("error", "error")), str(reply.get("kind"))
        if kind in ("Closed", "Busy"):  # the server closes this connection, and says why
            raise (Dropped if kind == "Closed" else Refused)(error)
        raise _ERRORS.get(kind, RuntimeError if kind == "RuntimeError" else RemoteError)(error)

    def _parting_words(self) -> None:
        """The server closed the connection before our request went out: raise what it said
        on its way out (a refusal, a deadline), if it said anything."""
        try:
            reply = decode_reply(self._line(0.5))
        except (OSError, ProtocolError, NoLiveRun):
            return
        if reply.get("kind") in ("Closed", "Busy") and not reply.get("ok"):
            raise (Dropped if reply["kind"] == "Closed" else Refused)(str(reply.get("error")))

    def stream(self, cursor: int = 0, timeout: float | None = None) -> Iterator[tuple[SessionEvent, int]]:
        """Subscribe and yield (event, cursor) as they happen (the backlog after ``cursor`` first)
        until the run ends, the connection closes, or nothing arrives for ``timeout``."""
        result = self.call("events", cursor=cursor, subscribe=True)
        for data in result["events"]:
            yield event_from_dict(data), result["cursor"]
        while True:
            try:
                message = decode_reply(self._line(timeout))
            except (TimeoutError, NoLiveRun, OSError):
                return
            if "event" in message:
                yield event_from_dict(message["event"]), int(message["cursor"])
