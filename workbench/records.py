"""Rules about the plain records every layer reads (metric names, live-edit records),
defined once for the core, the session and the front-ends.

Torch-free, so the CLI and the front-ends can use them without loading the training stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["is_timing_metric", "RECORD_FIELDS", "edit_changes"]


def is_timing_metric(name: str) -> bool:
    """Whether a metric measures time or speed (``*_runtime``, ``*_per_second``): these vary
    from run to run, so tables, comparisons and best-metric choices leave them out."""
    return name.endswith(("_runtime", "_per_second"))


# The bookkeeping fields of a live-edit record; every other key is an edited value.
RECORD_FIELDS = ("step", "time", "reason")


def edit_changes(record: Mapping[str, Any]) -> dict[str, Any]:
    """The edits of a live-edit record, without its step, time and reason."""
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS}
