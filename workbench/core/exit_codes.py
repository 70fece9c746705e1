"""The process exit codes of ``workbench`` commands, in one place (the README lists them).

0 finished; 1 training failed; 2 a usage or config error (one line on stderr); 3 no live run
answers (``workbench ctl``), or a run stopped itself after a hang (``hang_action = "stop"``:
a scheduler restarts it, and ``--resume`` goes on from the last checkpoint); 129 stopped by SIGHUP (the terminal closed) after a checkpoint;
130 Ctrl-C or a stop without saving; 143 stopped by SIGTERM after the just-in-time checkpoint
(schedulers must see "preempted", not "finished").
"""

from __future__ import annotations

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_NO_RUN", "EXIT_HUNG", "EXIT_HANGUP", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "OUTCOME_CODES", "run_exit_code"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_RUN = 3
EXIT_HUNG = 3  # workbench run: a step stood still for hang_timeout (distributed/health.py); not a failure
EXIT_HANGUP = 129
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# How a dashboard session ended, and the code the CLI exits with for it.
OUTCOME_CODES = {
    "finished": EXIT_OK,            # the run ended on its own (or had ended when the user quit)
    "saved": EXIT_OK,               # quit dialog: stop and save (q then Enter)
    "stopped": EXIT_INTERRUPTED,    # quit dialog: stop without saving
    "interrupted": EXIT_INTERRUPTED,  # ctrl+c: stop and save, then exit
    "aborted": EXIT_INTERRUPTED,    # a second ctrl+c: exit without waiting for the save
    "terminated": EXIT_TERMINATED,  # SIGTERM: stop and save, then exit
    "hangup": EXIT_HANGUP,          # SIGHUP (the terminal closed): stop and save, then exit
    "failed": EXIT_FAILED,
    "crashed": EXIT_FAILED,         # the dashboard itself failed; a local run was stopped and saved
    "detached": EXIT_OK,            # an attached dashboard left; the run goes on elsewhere
}


def run_exit_code(status: str, stop_reason: str | None = None, saved: bool = True,
                  interrupted: bool = False) -> int:
    """The code ``workbench run`` (headless) exits with for a run that ended so: one rule for
    the CLI and for the outcome a run reports to its clients before its endpoint closes.

    ``status``: finished, stopped or failed; ``stop_reason``: who stopped it (SIGTERM,
    SIGINT, session...); ``saved``: whether the stop saved a checkpoint; ``interrupted``: a
    second Ctrl-C ended it without waiting for the save.
    """
    if interrupted:
        return EXIT_INTERRUPTED
    if status == "failed":
        return EXIT_FAILED
    if stop_reason == "SIGTERM":
        return EXIT_TERMINATED
    if stop_reason == "SIGHUP":
        return EXIT_HANGUP
    if stop_reason == "SIGINT" or (stop_reason is not None and not saved):
        return EXIT_INTERRUPTED
    return EXIT_OK
