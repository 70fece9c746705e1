"""The autopilot: policies that steer a run within limits (issue 28).

``Autopilot(session, PlateauPolicy(), Limits({"lr_scale": (0.25, 1.0)})).start()`` follows
any SessionLike (a local Session, or a run attached to) as a client: it reads events and
snapshots, checks each change a policy asks for against the limits (which keys, which
ranges, how many changes per how many steps), and sends it with its reason, or only proposes
it (``dry_run=True``) on the run, for a person to accept wherever they watch it (the dashboard,
the panel, ``workbench ctl``, a script), in any process. With
``revert_after``, a change that leaves the watched metric worse is undone. Importing it
imports neither torch nor a front-end library.
"""

from __future__ import annotations

from workbench.autopilot.limits import Action, Limits, describe_changes
from workbench.autopilot.pilot import DECISION_STATES, Autopilot, Decision
from workbench.autopilot.policies import Observation, PlateauPolicy, Policy, SpikePolicy, metric_values

__all__ = ["Autopilot", "Decision", "DECISION_STATES", "Action", "Limits", "describe_changes", "Observation",
           "Policy", "PlateauPolicy", "SpikePolicy", "metric_values"]
