"""What a run's own console says when a client steers it: one line per command from
``workbench ctl``, an attached dashboard or a script, saying who, what and at which step.

Someone reading a headless run's output must not find it paused, its learning rate changed or
its process gone without a word: the control server hands each steering command's outcome
here, and the line goes to the run's ``announce`` (the CLI prints it; a Session in a notebook
has none). A pause takes effect at the next step boundary, so it is told once it has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from workbench.door.endings import CLIENTS, describe_end
from workbench.door.proposals import describe_changes
from workbench.door.values import Status

__all__ = ["announcement", "tell_when_paused", "client_words"]

# What the pause watcher waits through: anything else means the pause happened, or will not.
_ON_THE_WAY = (Status.PAUSING,)
_POLL_S = 0.05


def client_words(who: str | None) -> str:
    """"workbench ctl", "an attached dashboard (workbench attach)", ... for a hello's client name."""
    return CLIENTS.get(who or "remote", CLIENTS["remote"])


def announcement(cmd: str, args: Mapping[str, Any], result: Any, who: str | None, step: int) -> str | None:
    """The console line for a steering command that was answered ``result`` (None: nothing
    to tell, e.g. a read or a listing). ``step``: the run's step when it was answered."""
    from workbench.widgets.view import fmt_plain  # the front-ends' way of writing a value (not at import)

    by = f"from {client_words(who)}"
    done = result if isinstance(result, Mapping) else {}
    if cmd == "resume":
        return f"resumed {by} at step {step}"
    if cmd == "stop":
        how = "saving a checkpoint first" if args.get("save", True) else "without saving"
        return f"stopping {by} at step {step} ({how})"
    if cmd == "save":
        if "checkpoint" in done:
            return f"saved {Path(str(done['checkpoint'])).name} {by}"
        return f"save asked {by} at step {step} (at the next step end)"
    if cmd == "evaluate":
        metrics = done.get("metrics")
        if isinstance(metrics, Mapping):
            shown = {k: v for k, v in metrics.items() if k in ("eval_loss", "eval_accuracy", "eval_perplexity")}
            return f"evaluated {by} at step {step}" + (f": {fmt_plain(shown)}" if shown else "")
        return f"evaluation asked {by} at step {step} (at the next step end)"
    if cmd == "set":
        applied = done.get("applied")
        why = f" ({args['reason']})" if args.get("reason") else ""
        if isinstance(applied, Mapping):
            return f"set {fmt_plain(dict(applied))} {by} at step {step}{why}"
        return f"edit asked {by} at step {step}: {fmt_plain(dict(args.get('changes') or {}))}{why}"
    if cmd == "propose" and "id" in done:  # a headless run's reader learns that a proposal waits for them
        why = f" ({args['reason']})" if args.get("reason") else ""
        source = f"from {args['source']} via {client_words(who)}" if args.get("source") else by
        return (f"proposal {done['id']} {source} at step {step}: {describe_changes(args.get('changes') or {})}{why}; "
                f"accept or reject it: workbench ctl OUTDIR accept {done['id']} (or reject {done['id']})")
    if cmd == "decide" and "state" in done:
        verb = "rejected" if done["state"] == "rejected" else "accepted"
        return f"{verb} proposal {done.get('id')} ({describe_changes(done.get('changes') or {})}) {by} at step {step}"
    if cmd == "fork" and isinstance(done.get("variants"), Mapping):  # variants trained; the run is back at its pause
        return (f"forked {by} at step {done.get('step')}: {', '.join(done['variants'])} trained "
                f"{done.get('steps')} steps each; keep one, save one or discard")
    if cmd == "keep" and done.get("reason"):
        return f"{done['reason']} {by}; paused at step {step}"
    if cmd == "save_variant" and isinstance(result, str):
        return f"fork variant {args.get('name')} saved to {result} {by}"
    if cmd == "discard":
        return f"fork discarded {by}: the run goes on from step {step} unchanged"
    if cmd == "checkpoints":
        action, name = args.get("action"), args.get("name") or args.get("checkpoint")
        if action == "delete":
            return f"deleted {name} {by}"
        if action == "resume_from":
            # The run it replaces ended unsaved: said in the words of every ending (door/endings.py).
            return f"restarting from {Path(str(name)).name} {by} ({describe_end('stopped', None, step, False)})"
        if action == "branch":
            return f"branching from {Path(str(name)).name} into {done.get('output_dir') or args.get('output_dir')} {by}"
    return None


def tell_when_paused(status: Callable[[], Any], step: Callable[[], int], who: str | None,
                     announce: Callable[[str], None]) -> None:
    """A pause asked for lands at the next step boundary: tell it then, from a daemon thread
    (the command's reply does not wait for it). Nothing is told if the run resumes or ends first."""
    by = f"from {client_words(who)}"

    def watch() -> None:
        try:
            while (now := status()) in _ON_THE_WAY:
                time.sleep(_POLL_S)
            if now == Status.PAUSED:
                announce(f"paused {by} at step {step()}")
        except ReferenceError:  # the Session is gone: no one to tell
            return

    if status() == Status.PAUSED:
        announce(f"paused {by} at step {step()}")
    else:
        threading.Thread(target=watch, name="workbench-control-told", daemon=True).start()
