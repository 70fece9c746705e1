"""Rules about metric names, defined once for the core, the session and the front-ends.

Torch-free, so the CLI and the front-ends can use them without loading the training stack.
"""

from __future__ import annotations

__all__ = ["is_timing_metric"]


def is_timing_metric(name: str) -> bool:
    """Whether a metric measures time or speed (``*_runtime``, ``*_per_second``): these vary
    from run to run, so tables, comparisons and best-metric choices leave them out."""
    return name.endswith(("_runtime", "_per_second"))
