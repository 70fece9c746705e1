"""The commands of ``workbench ctl``, one line each: what ``ctl --help`` lists and what an
unknown command is checked against. Kept apart from ctl.py so the argument parser reads
them without importing the client (every ``workbench`` invocation builds that parser)."""

from __future__ import annotations

import difflib

__all__ = ["CTL_COMMANDS", "CTL_ALIASES", "ctl_epilog", "resolve_command"]

CTL_COMMANDS = {
    "status": "where the run is: status, step, loss, learning rate, speed, time ledger, a hang, ranks",
    "pause": "pause at the next step boundary (--wait: return once it is paused)",
    "resume": "continue a paused run exactly where it was",
    "save": "save a checkpoint (now if paused, else at the next step end) and name it",
    "eval": "evaluate (now if paused, else at the next step end); also: evaluate",
    "stop": "stop the run, saving a checkpoint first (--no-save: without one)",
    "set": "change hyperparameters live: KEY=VALUE ... (learning_rate, max_steps, ...; --reason)",
    "checkpoints": "list | delete NAME | resume_from NAME [KEY=VALUE] | branch NAME NEWDIR [KEY=VALUE]",
    "proposals": "the changes proposed to the run (by an autopilot in dry-run mode, ...): pending and decided",
    "accept": "accept proposal N: the run applies it as a live edit naming the proposal (--reason)",
    "reject": "reject proposal N: nothing changes (--reason says why)",
    "fork": "from the paused run: STEPS NAME: [KEY=VALUE, ...] ... (each variant one argument); their numbers",
    "keep": "continue the run from fork variant NAME (--reason)",
    "save_variant": "save fork variant NAME as a checkpoint of its own: NAME [FOLDER] (also: save-variant)",
    "discard": "drop the fork's variants: the run goes on from the pause unchanged",
}
# Other names a command answers to (the Session's method is evaluate(); the dashboard's key says eval).
CTL_ALIASES = {"evaluate": "eval", "save-variant": "save_variant"}


def ctl_epilog() -> str:
    """The command list under ``workbench ctl --help``: one line each, then the output options."""
    width = max(len(name) for name in CTL_COMMANDS)
    lines = ["commands:"] + [f"  {name:<{width}}  {text}" for name, text in CTL_COMMANDS.items()]
    lines += ["", "Replies are printed for people (applied: learning_rate 1e-4); --json prints them for tools.",
              "Exit codes: 0 done, 2 a bad command or value (the run's one-line refusal), 3 no live run answers."]
    return "\n".join(lines)


def resolve_command(word: str) -> str:
    """The command ``word`` names (an alias resolved); ValueError with a "did you mean" otherwise."""
    name = CTL_ALIASES.get(word, word)
    if name in CTL_COMMANDS:
        return name
    close = difflib.get_close_matches(word, [*CTL_COMMANDS, *CTL_ALIASES], n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"unknown command {word!r}{hint}; use one of: {', '.join(CTL_COMMANDS)}")
