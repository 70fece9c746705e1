"""SessionLike: the one door front-ends use to watch and steer a run.

The terminal dashboard and the notebook panel (``workbench.widgets``) are written against
this protocol and the value types in ``workbench.door.values``, never against the
Session class, the trainer or the checkpoint store. The local :class:`~workbench.session.local.Session`
implements it; a client attached to a run in another process can implement it too,
because everything crossing the door is plain data: statuses, snapshots, events,
checkpoint rows, memory readings, dicts of numbers and strings, paths, and Futures of
those. No model, optimizer or trainer object is passed through it.

Every command is checked once, behind the door: a front-end sends what the user typed
and shows the one-line ValueError or RuntimeError it gets back, so the dashboard, the
notebook and a script refuse the same inputs with the same words.

Importing this module imports neither torch nor any front-end library.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from workbench.door.values import (ENDED, CheckpointRow, Intervention, MemoryUsage, Proposal, SessionEvent, Snapshot,
                                   Status)

__all__ = ["SessionLike", "Status", "ENDED", "Snapshot", "SessionEvent", "CheckpointRow", "MemoryUsage", "Intervention",
           "Proposal"]


@runtime_checkable
class SessionLike(Protocol):
    """What a front-end may ask of a training run. See Session for the full behaviour.

    Commands raise ValueError (bad input: the message says what is wrong and how to fix it)
    or RuntimeError (not possible in the run's current state), always with one line.
    """

    # -- watching ---------------------------------------------------------------------

    @property
    def status(self) -> Status:
        """Where the run is now."""
        ...

    @property
    def stop_reason(self) -> str | None:
        """Why the run was stopped ("SIGTERM", "SIGINT", "session", ...), None if it was not."""
        ...

    @property
    def successor(self) -> SessionLike | None:
        """The run a branch handed this run's process to (it serves its own endpoint in its
        own folder), None if none: a front-end follows it as it follows a branch it made."""
        ...

    def snapshot(self) -> Snapshot:
        """The latest immutable view of the run (cheap; poll it)."""
        ...

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        """The events after ``cursor`` (0: from the first kept) and the cursor for the next call."""
        ...

    def arguments(self) -> dict[str, Any]:
        """The run's training arguments as a JSON-friendly dict."""
        ...

    # -- lifecycle and commands ------------------------------------------------------------

    def start(self) -> SessionLike:
        """Start an idle run; returns at once."""
        ...

    def wait(self, timeout: float | None = None) -> Status:
        """Block until the run ends (or ``timeout``); re-raises the run's error."""
        ...

    def pause(self, wait: bool = False, timeout: float | None = None) -> Status:
        """Pause at the next step boundary (``wait=True``: until paused)."""
        ...

    def resume(self) -> Status:
        """Continue a paused run."""
        ...

    def stop(self, save: bool = True, reason: str | None = None) -> Status:
        """Stop at the next safe point, saving a checkpoint first unless ``save=False``.
        ``reason``: who asks (door/endings.py: "dashboard", "notebook", "SIGINT", ...), so
        the run's end says who stopped it; a run in another process records its client's name."""
        ...

    def save(self) -> Future[Any] | Path:
        """Save a checkpoint: its path when paused, else a Future of it."""
        ...

    def evaluate(self) -> Future[Any] | dict[str, float]:
        """Evaluate: the metrics when paused or ended, else a Future of them."""
        ...

    def validate_edits(self, changes: Mapping[str, Any], reason: str | None = None) -> dict[str, Any]:
        """Check live edits (numbers, or text as typed) by the one rule set() applies; returns them parsed."""
        ...

    def set(self, reason: str | None = None, **changes: Any) -> Future[Any] | dict[str, Any]:
        """Change hyperparameters live (checked as validate_edits checks them); ``reason``
        (one line, optional) is stored with the edit's record and ``edit`` event. A change of
        the schedule's shape is ``schedule={"op": "decay_now" | "extend" | "rewarm" |
        "scale_peak", ...}`` (or its text, as typed: ``"decay_now steps=200 to=min_lr"``)."""
        ...

    def lr_plan(self, schedule: Mapping[str, Any] | str | None = None) -> tuple[tuple[int, float], ...]:
        """The learning rate planned for the rest of the run as ``(step, rate)`` pairs; with
        ``schedule``, what it would be after that change (the preview; nothing is applied)."""
        ...

    # -- proposals: changes waiting for a person (door/proposals.py) -------------------------------

    def propose(self, changes: Mapping[str, Any], reason: str | None = None, source: str | None = None) -> int:
        """Put a change on the run for a person to decide (nothing is applied): checked as
        set() checks it, kept (at most MAX_PENDING waiting), published in the snapshot and as a
        ``proposal`` event. ``source``: who proposes ("autopilot/plateau"). Returns its id."""
        ...

    def proposals(self) -> tuple[Proposal, ...]:
        """The run's proposals: every pending one and the newest decided ones, oldest first."""
        ...

    def decide(self, proposal_id: int, accept: bool, reason: str | None = None) -> Proposal:
        """Accept (applied through set(), a live edit whose reason names the proposal) or
        reject a pending proposal; ``reason``: the decider's why. A ``proposal_decided``
        event tells everyone. Returns the proposal as decided."""
        ...

    # -- A/B forks from the paused run --------------------------------------------------------------

    def fork_cost(self, variants: Mapping[str, Mapping[str, Any]], steps: int,
                  max_memory: int | None = None) -> dict[str, Any]:
        """The host memory a fork would hold (``bytes``, ``bytes_each``, ``limit``, ``fits``), before it starts."""
        ...

    def fork(self, variants: Mapping[str, Mapping[str, Any]], steps: int, evaluate: bool = True,
             max_memory: int | None = None) -> dict[str, Any]:
        """Train each variant (live edits by name; ``{}`` is the parent) ``steps`` steps from the
        pause on the same batches and RNG, evaluate it, put the run back at the pause; returns
        the report (also in ``snapshot().fork``). Then ``keep(name)`` or ``discard()``."""
        ...

    def keep(self, name: str, reason: str | None = None) -> dict[str, Any]:
        """Continue from variant ``name``'s end state (recorded as an edit naming the fork and its numbers)."""
        ...

    def discard(self) -> None:
        """Continue from the pause point unchanged."""
        ...

    def save_variant(self, name: str, output_dir: str | None = None, reason: str | None = None) -> str:
        """Write variant ``name``'s end state as a checkpoint in ``output_dir`` (a new or empty
        folder; by default ``OUTPUT_DIR-forkN-NAME``) that resumes as the kept variant would go on; the run stays at the pause and the
        fork undecided. Returns the checkpoint's path."""
        ...

    # -- looking inside (plain data only) ------------------------------------------------------

    def memory(self) -> MemoryUsage:
        """A fresh memory reading."""
        ...

    def inspect(self) -> dict[str, Any]:
        """Per-layer statistics ({"step", "layers": [{...}], "learning_rates", "batch_shapes", "can_sample"})."""
        ...

    def sample(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int | None = 20,
               seed: int = 0) -> str:
        """Text the paused causal LM generates from ``prompt``."""
        ...

    # -- checkpoints --------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointRow]:
        """The run's checkpoint catalog, oldest first."""
        ...

    def delete_checkpoint(self, name: str) -> None:
        """Delete a checkpoint by name; the protected ones and the one in use are refused."""
        ...

    def resume_from(self, checkpoint: str | Path, *, other_run: bool = False) -> SessionLike:
        """Restart this run from one of its checkpoints (a name, or a path in its output_dir;
        another run's only with ``other_run``) where it runs (a RemoteSession: in the run's
        process). The checkpoint must verify and fit the model, checked first; then a live run
        is stopped, without saving. Returns once restarted."""
        ...

    def parse_overrides(self, text: str | Mapping[str, str]) -> dict[str, Any]:
        """``"key=value, key=value"`` or ``{key: text}`` as typed, read into a dict of overrides."""
        ...

    def check_branch(self, checkpoint: str | Path, output_dir: str | Path, *, other_run: bool = False,
                     **overrides: Any) -> dict[str, Any]:
        """Everything branch() refuses, checked without side effects; returns the overrides validated."""
        ...

    def branch(self, checkpoint: str | Path, output_dir: str | Path, save: bool = True, *, other_run: bool = False,
               **overrides: Any) -> SessionLike:
        """A new run from ``checkpoint`` (as resume_from() takes it) into ``output_dir``, a new
        or empty folder, with changed arguments. A
        live run is stopped first (with a checkpoint unless ``save=False``) and the branch is
        started (a RemoteSession's in the run's process, and attached to); from an ended local
        run the branch is returned not started."""
        ...
