"""An agent that steers a live run from outside: halve the learning rate on a plateau.

    workbench run examples/mlp.toml --headless &      # any run (control is on by default)
    python examples/agent_lr_policy.py runs/mlp --patience 3
    python examples/agent_lr_policy.py runs/mlp --dry-run   # only propose: a person decides

It attaches to the run (``workbench.attach``) and runs the autopilot's plateau policy on it
(``workbench.autopilot``): when the evaluation loss has not improved for ``patience``
evaluations in a row, the learning rate is halved through ``set(lr_scale=0.5, reason=...)``,
within limits (only ``lr_scale``, only 0.5, at most ``max_cuts`` times). The run records
every decision with its reason as a live edit (in events.jsonl and the next checkpoint);
only the public client is used, and the run checks every edit itself. With ``--dry-run`` each
change is only proposed, on the run: a person accepts or rejects it from the dashboard (``o``),
the notebook panel or ``workbench ctl runs/mlp accept N``, and the agent follows the answer.
"""

from __future__ import annotations

import argparse

import workbench
from workbench.autopilot import Autopilot, Limits, PlateauPolicy

# "At most max_cuts changes per this many steps": the whole run, so max_cuts in all.
WHOLE_RUN = 10**9


def watch_and_steer(target: str, patience: int = 3, min_delta: float = 0.0, max_cuts: int = 5,
                    dry_run: bool = False, interval: float = 0.1) -> list[dict]:
    """Follow the run at ``target`` until it ends; returns the changes the run applied
    (``step``, ``applied``, ``reason`` as recorded with the edit)."""
    run = workbench.attach(target)
    try:
        pilot = Autopilot(run, PlateauPolicy(patience=patience, min_delta=min_delta),
                          Limits({"lr_scale": (0.5, 0.5)}, max_changes=max_cuts, per_steps=WHOLE_RUN),
                          dry_run=dry_run, interval=interval)
        pilot.run()
    finally:
        run.close()
    for decision in pilot.decisions:
        print(decision.line())
    return [{"step": d.step, "applied": dict(d.applied or {}), "reason": d.sent} for d in pilot.applied()]


def main() -> None:
    """The command line: the run's output_dir (or HOST:PORT) and the policy's settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the run's output_dir (or HOST:PORT)")
    parser.add_argument("--patience", type=int, default=3, help="evaluations without improvement before a cut")
    parser.add_argument("--min-delta", type=float, default=0.0, help="the smallest change that counts as better")
    parser.add_argument("--max-cuts", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true",
                        help="only propose each change on the run, for a person to accept or reject")
    ns = parser.parse_args()
    decisions = watch_and_steer(ns.target, ns.patience, ns.min_delta, ns.max_cuts, ns.dry_run)
    print(f"{len(decisions)} change(s) applied")


if __name__ == "__main__":
    main()
