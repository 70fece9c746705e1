"""Remote control of a live run: a control server on rank 0 and a client that attaches to it.

``protocol`` (message shapes, encoding, limits), ``discovery`` (``output_dir/control.json``
and the runtime socket folder), ``server`` (the endpoint a Session serves while it runs) and
``client`` (``attach()``: a ``RemoteSession`` implementing SessionLike over the socket).
This package is in the session layer: it imports the session's protocol and value types,
never a front-end, and the core never imports it.
"""

from __future__ import annotations

__all__ = ["attach"]


def attach(target: str, timeout: float = 5.0):
    """A RemoteSession on the live run at ``target`` (an output_dir, or HOST:PORT)."""
    from workbench.control.client import attach as _attach

    return _attach(target, timeout=timeout)
