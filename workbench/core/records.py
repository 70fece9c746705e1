"""The plain records every layer reads (checkpoint rows, memory readings) and the rules
about them (metric names, live-edit records), defined once for the core, the session and
the front-ends.

Torch-free, so the CLI and the front-ends can use them without loading the training stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

__all__ = ["is_timing_metric", "RECORD_FIELDS", "ROW_EDITS", "edit_changes", "CheckpointRow", "MemoryUsage"]


def is_timing_metric(name: str) -> bool:
    """Whether a metric measures time or speed (``*_runtime``, ``*_per_second``): these vary
    from run to run, so tables, comparisons and best-metric choices leave them out."""
    return name.endswith(("_runtime", "_per_second"))


# The bookkeeping fields of a live-edit record; every other key is an edited value. "memory":
# the device's figures an out-of-memory recovery's edit carries (train/oom.py), what made it,
# not something changed; "fork": the fork a kept or saved variant came from (its change is a
# record of its own).
RECORD_FIELDS = ("step", "time", "reason", "memory", "fork")


def edit_changes(record: Mapping[str, Any]) -> dict[str, Any]:
    """The edits of a live-edit record, without its step, time, reason, memory figures and fork."""
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS}


# A catalog row carries the newest few live edits of its checkpoint, and their count: every
# client receives the catalog with each snapshot, and a run with 1,000 edits (long reasons
# included) made every row megabytes long.
ROW_EDITS = 5

_Row = TypeVar("_Row")


class _PlainRecord:
    """Conversion of a frozen record dataclass to and from plain dicts (JSON, the control protocol)."""

    @classmethod
    def from_dict(cls: type[_Row], data: Mapping[str, Any]) -> _Row:
        """A record from a mapping with these field names (extra keys are ignored, so a
        newer writer's records still load)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-friendly dict."""
        return asdict(self)


@dataclass(frozen=True)
class CheckpointRow(_PlainRecord):
    """One row of a run's checkpoint catalog (checkpoint/store.py reads it from the folder).

    ``complete``: its manifest exists (a resume may pick it); ``verified``: its files were
    checked against the manifest (None: not checked); ``protected``: the best or the
    newest complete checkpoint, which rotation and deletion refuse to remove; ``problem``:
    why it is unreadable, if it is.
    """

    name: str
    path: str
    step: int
    epoch: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    size: int = 0
    created: float | None = None
    complete: bool = False
    verified: bool | None = None
    best: bool = False
    protected: bool = False
    problem: str | None = None
    edits: list[dict[str, Any]] = field(default_factory=list)  # the newest ROW_EDITS live edits up to it
    edit_count: int = 0  # every live edit up to this checkpoint (its trainer_state.json has them all)
    foreign: bool = False  # written by transformers' Trainer: no manifest, resumable unverified


@dataclass(frozen=True)
class MemoryUsage(_PlainRecord):
    """One memory reading, in bytes (train/memory.py takes it): the model's own tensors
    (exact), the device's allocator counters (None where the device keeps none, e.g. the
    CPU) and the host process. ``frozen_parameters`` is the part of ``parameters`` that
    does not train (a LoRA run's base model; 0 when every parameter trains)."""

    parameters: int
    gradients: int
    optimizer_state: int
    device_type: str
    device_allocated: int | None
    device_reserved: int | None
    device_peak: int | None
    host_rss: int
    host_peak: int
    frozen_parameters: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The reading as a plain dict (numbers and a word: no deep copy needed, and a control
        server converts one per published snapshot)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
