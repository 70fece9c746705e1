"""The front-end door: what every front-end (the dashboard, the notebook panel, ``workbench
ctl``/``attach``/``watch``, an agent) knows of a run, and nothing else.

``protocol.py`` is ``SessionLike``, the methods a front-end calls; ``values.py`` the plain
values they return (``Status``, ``Snapshot``, ``SessionEvent``, ...: numbers, strings,
tuples, no torch); ``commands.py`` the rules a command is checked by. A local ``Session``
(workbench/session/) and a ``RemoteSession`` over a socket (workbench/control/client.py)
both implement it, so the same front-end works on either.
"""
