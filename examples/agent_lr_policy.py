"""An agent that steers a live run from outside: halve the learning rate on a plateau.

    workbench run examples/mlp.toml --headless &      # any run (control is on by default)
    python examples/agent_lr_policy.py runs/mlp --patience 3

It attaches to the run (``workbench.attach``), follows its event stream, and when the
evaluation loss has not improved for ``patience`` evaluations in a row, halves the learning
rate through ``set(lr_scale=0.5, reason=...)``: the run records every decision with its
reason as a live edit (in events.jsonl and the next checkpoint). Only
the public client is used; the run checks every edit itself.
"""

from __future__ import annotations

import argparse
import math

import workbench


def watch_and_steer(target: str, patience: int = 3, min_delta: float = 0.0, max_cuts: int = 5) -> list[dict]:
    """Follow the run at ``target`` until it ends; returns the decisions taken."""
    run = workbench.attach(target)
    best, stale, decisions = math.inf, 0, []
    for event in run.events(cursor=0):
        if event.kind in ("finished", "failed"):
            break
        if event.kind != "evaluated" or "eval_loss" not in event.data:
            continue
        loss = float(event.data["eval_loss"])
        if loss < best - min_delta:
            best, stale = loss, 0
            continue
        stale += 1
        if stale < patience or len(decisions) >= max_cuts:
            continue
        reason = f"eval_loss {loss:.4g} has not improved on {best:.4g} for {stale} evaluations"
        try:
            applied = run.set(lr_scale=0.5, reason=reason).result(timeout=120)
        except (ValueError, RuntimeError) as exc:  # the run refused it (or has just ended)
            print(f"step {event.step}: not applied: {exc}")
            break
        decisions.append({"step": event.step, "applied": applied, "reason": reason})
        print(f"step {event.step}: lr_scale x0.5 ({reason}) -> {applied}")
        stale = 0
    run.close()
    return decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the run's output_dir (or HOST:PORT)")
    parser.add_argument("--patience", type=int, default=3, help="evaluations without improvement before a cut")
    parser.add_argument("--min-delta", type=float, default=0.0, help="the smallest change that counts as better")
    parser.add_argument("--max-cuts", type=int, default=5)
    ns = parser.parse_args()
    decisions = watch_and_steer(ns.target, ns.patience, ns.min_delta, ns.max_cuts)
    print(f"{len(decisions)} decision(s)")


if __name__ == "__main__":
    main()
