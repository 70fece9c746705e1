"""The front-end door's old address: ``SessionLike`` and its values now live in
``workbench.door.protocol`` (below the front-ends, see docs/architecture.md). Kept so code
written against the earlier layout keeps importing."""

from workbench.door.protocol import (ENDED, CheckpointRow, Intervention, MemoryUsage, SessionEvent, SessionLike,
                                     Snapshot, Status)

__all__ = ["SessionLike", "Status", "ENDED", "Snapshot", "SessionEvent", "CheckpointRow", "MemoryUsage", "Intervention"]
