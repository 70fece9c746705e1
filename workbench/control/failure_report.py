"""How ``workbench run`` tells a failed run on the terminal, and with which exit code.

What the user fixes outside the code gets one line and no traceback: a control port taken
between the start-up check and the bind (exit 2, as that check's refusal), a full,
over-quota or read-only disk (exit 1: the run had started and failed; the checkpoints
saved before are intact, and ``--resume`` continues once the storage is fixed). Anything
else is a bug somewhere, and shows its traceback. ``events.jsonl`` is named only when the
run's error record really is there.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from workbench.core.exit_codes import EXIT_FAILED, EXIT_USAGE

__all__ = ["report_failure", "recorded_in"]


def report_failure(error: BaseException, output_dir: Path) -> int:
    """Print why the run in ``output_dir`` failed (stderr) and return the exit code."""
    from workbench.checkpoint.storage_errors import STORAGE_ERRNOS, CheckpointWriteError, classify, describe
    from workbench.control.endpoint_check import EndpointError

    if isinstance(error, EndpointError):
        print(f"workbench: {error}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(error, CheckpointWriteError):
        print(f"workbench: training failed: {error}{recorded_in(output_dir)}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS and error.filename:
        folder = Path(os.fsdecode(error.filename)).parent
        words = describe(classify(error, folder), error, folder)
        print(f"workbench: training failed: cannot write {os.fsdecode(error.filename)}: {words}"
              f"{recorded_in(output_dir)}", file=sys.stderr)
        return EXIT_FAILED
    traceback.print_exception(error)
    print(f"workbench: training failed{recorded_in(output_dir)}", file=sys.stderr)
    return EXIT_FAILED


def recorded_in(output_dir: Path) -> str:
    """``"; details in .../events.jsonl"`` when this process's error record ends that file
    (a full or read-only disk may have refused it), else nothing."""
    from workbench.core.event_file import EVENTS_FILE, error_recorded

    return f"; details in {Path(output_dir) / EVENTS_FILE}" if error_recorded(output_dir, os.getpid()) else ""
