"""The door's value types at their old address: they now live in ``workbench.door.values``
(importable without torch, as before). Kept so code written against the earlier layout keeps
importing."""

from workbench.door.values import (ENDED, SNAPSHOT_EDITS, SNAPSHOT_INTERVENTIONS, CheckpointRow, Intervention,
                                   MemoryUsage, SeriesStore, SessionEvent, Snapshot, Status)

__all__ = ["Status", "ENDED", "Snapshot", "SessionEvent", "CheckpointRow", "MemoryUsage", "Intervention",
           "SNAPSHOT_INTERVENTIONS", "SNAPSHOT_EDITS", "SeriesStore"]
