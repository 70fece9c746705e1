"""Check a TCP control endpoint before a run writes anything: the port, the host, a trial bind.

``workbench run --control-port 99999`` (or a port another program holds, or a host that is
no address of this machine) must be refused at once, as one line, before ``config.toml``
or anything else lands in output_dir; the server's own bind happens much later, once the
model and the data are built. The same check serves ``[training] control_port`` /
``control_host`` and ``TrainingArguments(control_port=...)`` (through the Session, whose
bind failure is this module's one line too).

A host that is not a loopback address makes the run reachable from the network: that is
allowed (every TCP client must present the token from control.json), and said once.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

__all__ = ["EndpointError", "bind_failure", "check_endpoint", "check_run_endpoint",
           "public_warning", "warn_if_public"]

log = logging.getLogger("workbench")

_WARNED: set[str] = set()  # hosts already warned about in this process
_WARNED_LOCK = threading.Lock()


class EndpointError(ValueError):
    """The control endpoint cannot be served as asked (one line that says how to fix it)."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET  # as ControlServer.start


def check_endpoint(port: object, host: object = None, *, port_name: str = "--control-port",
                   host_name: str = "--control-host") -> None:
    """Raise :class:`EndpointError` unless ``port`` (0..65535, 0: any free one) can be bound on
    ``host`` (default 127.0.0.1) now; ``port_name`` / ``host_name`` are how the user typed
    them (a CLI option or a ``training.`` key). Binds and closes a socket, nothing else."""
    if port is None:
        if host is not None:
            raise EndpointError(f"{host_name} names the address of a TCP endpoint; set {port_name} too")
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise EndpointError(f"{port_name}: expected a TCP port from 0 to 65535 (0: any free port), got {port!r}")
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise EndpointError(f"{host_name}: expected an address of this machine (e.g. 127.0.0.1), got {host!r}")
    address = host or "127.0.0.1"
    try:
        with socket.socket(_family(address), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what the server sets
            probe.bind((address, port))
    except OSError as exc:
        raise EndpointError(bind_failure(address, port, exc, port_name=port_name, host_name=host_name)) from None


def check_run_endpoint(cli_port: int | None, cli_host: str | None, training: object) -> str | None:
    """:func:`check_endpoint` for ``workbench run``: the command line's port and host, else
    ``[training]``'s, each named as the user gave it; returns the warning to print for an
    address other than loopback (None: nothing to say)."""
    port = cli_port if cli_port is not None else getattr(training, "control_port", None)
    host = cli_host if cli_host is not None else getattr(training, "control_host", None)
    from_cli = cli_port is not None or (port is None and cli_host is not None)
    check_endpoint(port, host, port_name="--control-port" if from_cli else "training.control_port",
                   host_name="--control-host" if cli_host is not None else "training.control_host")
    return public_warning(host) if port is not None else None


def bind_failure(host: str, port: int, exc: OSError, *, port_name: str = "--control-port",
                 host_name: str = "--control-host") -> str:
    """The one line for a failed bind of the control endpoint on ``host:port``."""
    import errno

    reason = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return (f"{host_name}: {host!r} is not an address of this machine ({reason}); name one it has, e.g. "
                "127.0.0.1 (the default) or 0.0.0.0 for every interface")
    if exc.errno == errno.EADDRINUSE:
        return (f"{port_name}: port {port} on {host} is already in use ({reason}); choose another "
                f"port, or 0 for any free one")
    if exc.errno == errno.EACCES:
        return (f"{port_name}: port {port} on {host} needs privileges ({reason}); choose a port above 1023, "
                "or 0 for any free one")
    return f"control endpoint: cannot listen on {host}:{port} ({reason})"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: loopback only if every address it has is
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def public_warning(host: object) -> str | None:
    """The warning for a TCP endpoint bound on a non-loopback ``host``, once per host and
    process (None when there is nothing, or nothing new, to say)."""
    if not isinstance(host, str) or not host or _is_loopback(host):
        return None
    with _WARNED_LOCK:
        if host in _WARNED:
            return None
        _WARNED.add(host)
    where = "every interface of this machine" if host in ("0.0.0.0", "::") else host
    return (f"warning: the control endpoint listens on {where}: the run is reachable from the network "
            "(a client needs the token in output_dir/control.json); bind 127.0.0.1 and use an SSH tunnel "
            "unless the network is trusted")


def warn_if_public(host: object) -> None:
    """Log :func:`public_warning` (a Session or ``Trainer.train()`` serving on such a host)."""
    text = public_warning(host)
    if text is not None:
        log.warning("workbench: %s", text)
