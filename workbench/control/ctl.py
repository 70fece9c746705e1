"""``workbench ctl OUTDIR COMMAND [ARGS] [--json]``: one command to a live run, from a shell.

Exit codes (workbench/core/exit_codes.py): 0 done; 2 a bad command or value (the run's own
one-line refusal); 3 no live run answers (no control.json, a stale one, nothing listening,
or a run that refused the connection, with its reason). Printing is here; the talking is
the client's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from workbench.control.client import RemoteError, RemoteSession, attach
from workbench.control.ctl_commands import CTL_COMMANDS, resolve_command
from workbench.control.ctl_fork import fork_text, run_fork_command
from workbench.control.discovery import NoLiveRun
from workbench.core.exit_codes import EXIT_NO_RUN, EXIT_OK, EXIT_USAGE

__all__ = ["run_ctl", "CTL_COMMANDS"]


FORK_COMMANDS = ("fork", "keep", "save_variant", "discard")
CHECKPOINT_USAGE = ("checkpoints [list | delete NAME | resume_from NAME [KEY=VALUE ...] | "
                    "branch NAME NEWDIR [KEY=VALUE ...] [--no-save]]")


def _parse_pairs(values: list[str], what: str = "set") -> dict[str, str]:
    """``KEY=VALUE`` words as typed (the run parses and checks the values)."""
    changes: dict[str, str] = {}
    for word in values:
        key, sep, value = word.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{what}: expected KEY=VALUE (e.g. learning_rate=1e-4), got {word!r}")
        changes[key.strip()] = value.strip()
    if not changes and what == "set":
        raise ValueError("set: give at least one KEY=VALUE, e.g. workbench ctl OUTDIR set learning_rate=1e-4")
    return changes


def _checkpoints(session: RemoteSession, target: str, values: list[str], save: bool) -> Any:
    """``checkpoints`` and its actions: list, delete, resume_from (restart this run from a
    checkpoint, in its process) and branch (a new run from a checkpoint, in its process)."""
    action, rest = (values[0], values[1:]) if values else ("list", [])
    if action == "list" and not rest:
        return [row.to_dict() for row in session.checkpoints]
    if action == "delete" and len(rest) == 1:
        session.delete_checkpoint(rest[0])
        return {"deleted": rest[0]}
    if action == "resume_from" and rest:
        overrides = session.parse_overrides(_parse_pairs(rest[1:], "resume_from"))
        session.resume_from(rest[0], **overrides)
        return {"resumed_from": rest[0], "status": str(session.status)}
    if action == "branch" and len(rest) >= 2:
        output_dir = rest[1]
        if Path(target).is_dir():  # same filesystem as the run: a folder as typed here
            output_dir = str(Path(output_dir).resolve())
        overrides = session.parse_overrides(_parse_pairs(rest[2:], "branch"))
        child = session.branch(rest[0], output_dir, save=save, **overrides)
        try:
            return {"branched_from": rest[0], "output_dir": child.info.get("output_dir"),
                    "status": str(child.status)}
        finally:
            child.close()
    raise ValueError(f"usage: {CHECKPOINT_USAGE}")


def _proposal_number(action: str, values: list[str]) -> int:
    """``accept N`` / ``reject N``: the proposal's number as typed."""
    if len(values) != 1 or not values[0].isdigit():
        raise ValueError(f"{action}: expected one proposal number (workbench ctl OUTDIR proposals lists them), "
                         f"got {' '.join(values) or 'none'}")
    return int(values[0])


def _execute(session: RemoteSession, action: str, values: list[str], wait: bool, save: bool,
             reason: str | None = None, target: str = "") -> Any:
    if action == "status":
        return session._call("status")
    if action == "pause":
        return {"status": str(session.pause(wait=wait))}
    if action == "resume":
        return {"status": str(session.resume())}
    if action == "stop":
        return {"status": str(session.stop(save=save)), "saved": save}
    if action == "save":
        return {"checkpoint": str(session.save().result())}
    if action == "eval":
        return {"metrics": session.evaluate().result()}
    if action == "set":
        return {"applied": session.set(reason=reason, **_parse_pairs(values)).result()}
    if action == "checkpoints":
        return _checkpoints(session, target, values, save)
    if action == "proposals":
        return [p.to_dict() for p in session.proposals()]
    if action in ("accept", "reject"):
        number = _proposal_number(action, values)
        return session.decide(number, action == "accept", reason=reason).to_dict()
    if action in FORK_COMMANDS:
        return run_fork_command(session, action, values, reason, target)
    raise ValueError(f"unknown command {action!r}; use one of: {', '.join(CTL_COMMANDS)}")


def _print(action: str, result: Any, target: str = "OUTDIR") -> None:
    if action == "status":
        loss = result.get("loss")
        parts = [f"{result['status']}", f"step {result['step']}/{result['max_steps']}"]
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if result.get("learning_rate") is not None:
            parts.append(f"lr {result['learning_rate']:.3g}")
        if result.get("steps_per_second"):
            parts.append(f"{result['steps_per_second']:.2f} steps/s")
        if result.get("elapsed") is not None:  # training time; the pauses apart (issue 29)
            from workbench.widgets.view import fmt_clock

            paused = result.get("paused") or 0.0
            parts.append(f"elapsed {fmt_clock(result['elapsed'])}" + (f" (paused {fmt_clock(paused)})" if paused >= 1
                                                                      else ""))
        print(f"{result.get('run_name') or 'run'}: " + ", ".join(parts))
        if result.get("health"):  # where the time goes, and a hang first (issue 27)
            from types import SimpleNamespace

            from workbench.widgets.view import health_line, ranks_line

            for line in (health_line(SimpleNamespace(health=result["health"])), ranks_line(result["health"])):
                if line:
                    print(line)
    elif action == "checkpoints" and isinstance(result, list):
        for row in result:
            state = "complete" if row["complete"] else "incomplete"
            print(f"{row['name']:<20} step {row['step']:>7} {state}{' *best' if row['best'] else ''}")
        if not result:
            print("no checkpoints yet")
    elif action == "proposals" and isinstance(result, list):
        from workbench.door.proposals import Proposal

        for row in result:
            print(Proposal.from_dict(row).line())
        if not result:
            print("no proposals")
    elif action in ("accept", "reject") and isinstance(result, dict):
        from workbench.door.proposals import Proposal

        proposal = Proposal.from_dict(result)
        said = {"accepted": "accepted: the run applies it at the next step end", "applied": "accepted and applied",
                "rejected": "rejected"}.get(proposal.state, proposal.state)
        print(f"proposal {proposal.id} ({proposal.change_text}) {said}")
    elif action in ("pause", "resume", "stop") and isinstance(result, dict):
        said = _STATUS_WORDS.get((action, result.get("status")), str(result.get("status")))
        if action == "stop" and result.get("saved") is False and result.get("status") == "stopping":
            said = "stopping: the run stops at the next step end, without saving"
        print(said)
    elif action == "eval" and isinstance(result, dict) and isinstance(result.get("metrics"), dict):
        from workbench.core.records import is_timing_metric
        from workbench.widgets.view import fmt_plain

        shown = {k: v for k, v in result["metrics"].items() if not is_timing_metric(k) and k != "epoch"}
        print(f"metrics: {fmt_plain(shown)}")
    elif action in FORK_COMMANDS and isinstance(result, dict):
        print(fork_text(action, result, target))
    elif action == "save" and isinstance(result, dict) and "checkpoint" in result:
        print(f"saved: {Path(str(result['checkpoint'])).name} ({result['checkpoint']})")
    elif isinstance(result, dict):
        # Values as a person types them (applied: learning_rate 1e-4), never a Python repr;
        # --json is the form for tools.
        from workbench.widgets.view import fmt_plain

        print("; ".join(f"{k.replace('_', ' ')}: {fmt_plain(v)}" for k, v in result.items()))
    else:
        print(result)


# What pause, resume and stop answered, in words ("pausing" alone does not say when).
_STATUS_WORDS = {
    ("pause", "pausing"): "pausing: the run pauses at the next step boundary (--wait waits for it)",
    ("pause", "paused"): "paused",
    ("resume", "running"): "resumed: running",
    ("stop", "stopping"): "stopping: the run saves a checkpoint and stops at the next step end",
}


def _last_words(target: str) -> str:
    """How the last run in an output_dir ended, for the "no live run" line ("" if unknown)."""
    from workbench.control.outcome import describe_outcome, last_outcome

    outcome = last_outcome(target) if os.path.isdir(target) else None
    return f"; {describe_outcome(outcome)}" if outcome is not None else ""


def run_ctl(target: str, action: str, values: list[str], as_json: bool = False, wait: bool = False,
            save: bool = True, token: str | None = None, reason: str | None = None) -> int:
    """Send one command to the run at ``target``; returns the exit code. ``reason``: set's why."""
    try:
        action = resolve_command(action)  # "evaluate" is "eval"; a typo gets "did you mean"
    except ValueError as exc:
        print(f"workbench: ctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if reason is not None and action not in ("set", "accept", "reject", "keep", "save_variant"):
        print(f"workbench: ctl {action}: --reason goes with set, accept, reject, keep and save_variant only",
              file=sys.stderr)
        return EXIT_USAGE
    if values and action not in ("set", "checkpoints", "accept", "reject", "fork", "keep", "save_variant"):
        print(f"workbench: ctl {action}: takes no arguments (got {' '.join(values)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        session = attach(target, token=token, client="ctl")
    except NoLiveRun as exc:
        print(f"workbench: {exc}{_last_words(target)}", file=sys.stderr)
        return EXIT_NO_RUN
    except PermissionError as exc:  # a wrong token
        print(f"workbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RemoteError as exc:  # it answers, in another protocol version
        print(f"workbench: {exc}", file=sys.stderr)
        return EXIT_NO_RUN
    try:
        result = _execute(session, action, values, wait, save, reason, target)
    except (NoLiveRun, OSError) as exc:
        print(f"workbench: {exc}", file=sys.stderr)
        return EXIT_NO_RUN
    except (ValueError, RuntimeError, RemoteError) as exc:
        print(f"workbench: ctl {action}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        session.close()
    if as_json:
        print(json.dumps(result, indent=2 if isinstance(result, list) else None, default=str))
    else:
        _print(action, result, target)
    return EXIT_OK
