"""Controls across ranks: decided once, applied by every rank at the same step boundary.

Pause, stop, save-now, evaluate-now and live edits come from rank 0's Session; a SIGTERM
or a callback's decision can come from any rank. Acting on any of them locally would let
the ranks drift apart (one saves while another waits in an all-reduce), so each rank only
*proposes* at a step end, and the loop acts on what all ranks agreed:

- one all-reduce (MAX) of a few integers per step: the stop request and its reason, the
  ``TrainerControl`` flags every callback set, rank 0's pause and "edits follow" bits;
- when rank 0 applied live edits, a broadcast of those (rare, pickled);
- while paused, the same exchange every 0.2 s as a heartbeat that also carries rank 0's
  paused-time actions (save, evaluate, edits) so every rank takes part in their
  collectives, and no rank sits in a collective long enough to time out.

The exchange runs on a gloo group: on CPU that is the default group; with NCCL a gloo
side group keeps these reads off the GPU stream (no device sync per step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["RankSync"]

# Stop reasons by priority: the highest proposal wins (a preemption outranks a UI stop).
_REASONS = ("", "session", "ui", "SIGUSR1", "SIGINT", "SIGTERM")
_STOP, _NOSAVE, _SAVE, _EVAL, _LOG, _TSTOP, _ESTOP, _PAUSE, _EDITS, _ACTION = range(10)
_CONTROL = {_SAVE: "should_save", _EVAL: "should_evaluate", _LOG: "should_log",
            _TSTOP: "should_training_stop", _ESTOP: "should_epoch_stop"}
_ACTIONS = ("", "save", "evaluate")
HEARTBEAT_S = 0.2


def _reason_code(reason: str | None) -> int:
    if not reason:
        return 0
    return _REASONS.index(reason) if reason in _REASONS else 1


class RankSync:
    """The per-step agreement between ranks (one per Trainer when there are several processes)."""

    def __init__(self, trainer: "Trainer") -> None:
        import torch.distributed as dist

        self.trainer = trainer
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        # A CPU group for a few integers: gloo's own default group, or a side group next to NCCL.
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._flags = torch.zeros(10, dtype=torch.int64)
        self._lock = threading.Lock()
        self._edits: list[dict[str, Any]] = []  # applied on rank 0 since the last exchange
        self.pause_wanted: Callable[[], bool] = lambda: False  # rank 0's Session installs its own
        self.paused = False  # agreed at the last exchange: every rank waits before the next step
        self.exchanges = 0

    # -- what rank 0 tells the others ------------------------------------------------------

    def publish_edit(self, record: dict[str, Any]) -> None:
        """Queue an edit rank 0 applied (a live-edit record) for the other ranks."""
        if self.is_main:
            with self._lock:
                self._edits.append(dict(record))

    # -- the exchange ---------------------------------------------------------------------------

    def _exchange(self, control=None, pause: bool = False, action: str = "") -> torch.Tensor:
        import torch.distributed as dist

        trainer = self.trainer
        flags = self._flags
        flags.zero_()
        request = trainer.stop_request
        if request.is_set():
            flags[_STOP] = _reason_code(request.reason)
            flags[_NOSAVE] = int(not request.save)
        if control is not None:
            for index, name in _CONTROL.items():
                if getattr(control, name):
                    flags[index] = 1
        if self.is_main:
            flags[_PAUSE] = int(pause)
            flags[_ACTION] = _ACTIONS.index(action)
            with self._lock:
                edits, self._edits = self._edits, []
            flags[_EDITS] = int(bool(edits))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.exchanges += 1
        if flags[_EDITS]:
            payload = [edits if self.is_main else None]
            dist.broadcast_object_list(payload, src=0, group=self.group)
            if not self.is_main:
                self._apply_edits(payload[0])
        if flags[_STOP] and not trainer.stop_decision.is_set():
            reason = _REASONS[int(flags[_STOP])] or "session"
            trainer.stop_decision.set(reason, save=not flags[_NOSAVE])
            if not request.is_set():  # this rank's own request now says why the run stopped
                request.set(reason, save=not flags[_NOSAVE])
        return flags

    def _apply_edits(self, records: list[dict[str, Any]]) -> None:
        from .session_state import apply_edit

        state = self.trainer.state
        for record in records:
            for key, value in record.items():
                if key not in ("step", "time"):
                    apply_edit(self.trainer, key, value)
            state.live_edits.append(dict(record))

    def step_end(self, control) -> None:
        """At each step end: agree on the control flags, stops, pauses and edits."""
        flags = self._exchange(control, pause=self.pause_wanted())
        for index, name in _CONTROL.items():
            setattr(control, name, bool(flags[index]))
        self.paused = bool(flags[_PAUSE])
        if self.trainer.stop_decision.is_set():
            self.trainer._jit_callback.act(control)

    def heartbeat(self, paused: bool, action: str = "") -> tuple[bool, str]:
        """One exchange while paused: (still paused, action every rank runs now)."""
        flags = self._exchange(pause=paused, action=action)
        still = bool(flags[_PAUSE]) and not self.trainer.stop_decision.is_set()
        return still, _ACTIONS[int(flags[_ACTION])]

    def follow_pause(self, run_action: Callable[[str], Any]) -> None:
        """On ranks other than 0: wait out rank 0's pause, joining its paused-time actions."""
        if self.is_main or not self.paused:
            return
        while True:
            still, action = self.heartbeat(False)
            if action:
                run_action(action)
            if not still:
                break
        self.paused = False
