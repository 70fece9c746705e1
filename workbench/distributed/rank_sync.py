"""Controls across ranks: decided once, applied by every rank at the same step boundary.

Pause, stop, save-now, evaluate-now and live edits come from rank 0's Session; a SIGTERM
can reach any rank. Acting on them locally would let the ranks drift apart (one saves
while another waits in an all-reduce), so a rank only *proposes*, and every rank acts on
what all of them agreed:

- an exchange is an all-reduce (MAX) of eight integers: the stop request and its reason,
  rank 0's save / evaluate / pause requests, an "edits follow" bit and the exchange
  interval. It is started without waiting, right after a step's gradient all-reduce
  (every rank is at the same point then, so it completes at once; started elsewhere, a
  gloo thread busy-waits for the slower rank and takes CPU from the compute: 6-10% of
  steps/s on 2 CPU ranks), and the next exchange point (a step end) collects and applies
  it, on every rank at the same step;
- exchange points come every ``every`` steps, an interval rank 0 derives from the step
  time (about 20 a second) and the ranks agree on like everything else; so on tiny steps
  the exchange costs a fraction of a percent, and a request waits at most ~0.1 s;
- when edits follow, rank 0 applies them and broadcasts the records (rare, pickled);
- while paused, the same exchange runs every 0.2 s as a heartbeat that also carries rank
  0's paused-time actions (save, evaluate, edits), so every rank takes part in their
  collectives and none sits in a collective long enough to time out.

Callbacks' own ``TrainerControl`` decisions are not exchanged: as in HF, callbacks are
expected to decide the same on every rank (they see the same state and gathered metrics).
The exchange uses its own gloo group, apart from the gradients' group, and never touches
the GPU, so it adds no device sync.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from workbench.core.edits import apply_edit, edit_changes
from workbench.core.run import Gate, Run


__all__ = ["RankSync", "HEARTBEAT_S", "FORK_ACTIONS"]


# Stop reasons by priority: the highest proposal wins (a preemption outranks a UI stop).
# The front-ends' names (door/endings.py words them) rank as "session" does, below the signals.
_REASONS = ("", "session", "remote", "notebook", "dashboard", "attach", "ctl", "guard", "resume_from", "branch", "ui",
            "SIGUSR1", "SIGINT", "SIGTERM")
_STOP, _NOSAVE, _SAVE, _EVAL, _PAUSE, _EDITS, _ACTION, _EVERY = range(8)
_ACTIONS = ("", "save", "evaluate", "fork", "keep", "discard", "save_variant")
# Their order (variants, steps, the kept or saved one) follows, broadcast.
FORK_ACTIONS = ("fork", "keep", "discard", "save_variant")
HEARTBEAT_S = 0.2
EXCHANGE_S = 0.05  # aim: about 20 exchanges a second, however short the steps
MAX_EVERY = 64


def _reason_code(reason: str | None) -> int:
    if not reason:
        return 0
    return _REASONS.index(reason) if reason in _REASONS else 1


class RankSync(Gate):
    """The agreement between ranks: the first of the loop's gates (core/run.py), which the
    Trainer installs when there are several processes (a single process needs none), so the
    loop itself has no rank special cases.

    At a step's start, ranks other than 0 wait out rank 0's pause (joining its paused-time
    save or evaluation); after the backward, when every rank has just left the gradients'
    all-reduce, the next exchange starts; at step ends the last one is applied (the stop gate
    after this one acts on an agreed stop at the same point); at the end of training the one
    in flight is collected.
    """

    def __init__(self, run: Run) -> None:
        import torch.distributed as dist

        self.run = run
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        self.group = dist.new_group(backend="gloo")  # collective: every rank builds its Trainer
        # One buffer is enough: an exchange in flight is always collected before the next is filled.
        self._flags = torch.zeros(8, dtype=torch.int64)
        self._work: Any = None  # the all-reduce started at the last step end
        self._lock = threading.Lock()
        self._requests: set[str] = set()  # "save" / "evaluate" asked for on rank 0
        self._records: list[dict[str, Any]] = []  # edits rank 0 applied while paused
        self.order: dict[str, Any] | None = None  # the last fork action's order from rank 0
        self._edits: list[tuple[dict[str, Any], Future]] = []  # edits to apply when agreed
        self._sent_edits: list[tuple[dict[str, Any], Future]] = []
        self._sent_records: list[dict[str, Any]] = []
        self.pause_wanted: Callable[[], bool] = lambda: False  # rank 0's Session installs its own
        # Rank 0's Session applies an edit and returns its live-edit record.
        self.apply_on_main: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.paused = False  # agreed: every rank waits before the next step
        self.every = 1  # agreed: steps between exchange points
        self._since = 0
        self._since_point = 0
        self._post_next = True  # the first exchange starts with the first step
        self._last_point: float | None = None  # rank 0's clock at the last exchange point

    # -- the gate's points ---------------------------------------------------------------------

    def step_start(self, run: Run) -> None:
        if not self.is_main and self.paused:
            self.follow_pause(self._run_paused_action)  # a stop agreed meanwhile: the stop gate acts next

    def after_backward(self, run: Run) -> None:
        self.start_exchange()

    def step_end(self, run: Run) -> None:
        self.exchange_point(run.control)

    def train_end(self, run: Run) -> None:
        self.finish()

    def _run_paused_action(self, action: str) -> None:
        """Take part, on a rank other than 0, in a save, evaluation or fork rank 0 runs while paused."""
        if action == "save":
            self.run.save_between_steps()
        elif action == "evaluate":
            self.run.evaluate_between_steps()
        else:
            self.run.fork_between_steps(action, self.order)

    # -- what rank 0 asks for --------------------------------------------------------------

    def request(self, kind: str) -> None:
        """Ask for a save or an evaluation on every rank (takes effect at the next agreement)."""
        with self._lock:
            self._requests.add(kind)

    def propose_edit(self, changes: dict[str, Any]) -> Future:
        """Queue a live edit; every rank applies it at the next agreement (the Future gets the result)."""
        future: Future = Future()
        with self._lock:
            self._edits.append((dict(changes), future))
        return future

    def publish_record(self, record: dict[str, Any]) -> None:
        """An edit rank 0 already applied (while paused) for the other ranks to apply too."""
        with self._lock:
            self._records.append(dict(record))

    # -- the exchange ---------------------------------------------------------------------------

    def _fill(self, flags: torch.Tensor, pause: bool, action: str = "", at_step: bool = True) -> None:
        request = self.run.stop_request
        flags.zero_()
        if request.is_set():
            flags[_STOP] = _reason_code(request.reason)
            flags[_NOSAVE] = int(not request.save)
        if self.is_main:
            with self._lock:
                requests, self._requests = self._requests, set()
                self._sent_edits, self._edits = self._edits, []
                self._sent_records, self._records = self._records, []
            flags[_SAVE] = int("save" in requests)
            flags[_EVAL] = int("evaluate" in requests)
            flags[_PAUSE] = int(pause)
            flags[_EDITS] = int(bool(self._sent_edits or self._sent_records))
            flags[_ACTION] = _ACTIONS.index(action)
            flags[_EVERY] = self._next_every() if at_step else self.every

    def _next_every(self) -> int:
        """Rank 0's proposal: steps per exchange so that exchanges come every EXCHANGE_S."""
        now = time.perf_counter()
        last, self._last_point = self._last_point, now
        if last is None or self._since_point == 0:
            return self.every
        step_s = (now - last) / self._since_point
        return max(1, min(MAX_EVERY, int(EXCHANGE_S / step_s) if step_s > 0 else MAX_EVERY))

    def _apply(self, flags: torch.Tensor, control=None) -> None:
        import torch.distributed as dist

        run = self.run
        if flags[_EDITS]:
            records = None
            if self.is_main:
                records = list(self._sent_records)
                for changes, future in self._sent_edits:
                    try:
                        record = self.apply_on_main(changes)
                    except Exception as exc:  # noqa: BLE001 - refused edits go back to the caller
                        future.set_exception(exc)
                        continue
                    future.set_result(edit_changes(record))
                    records.append(record)
                self._sent_edits, self._sent_records = [], []
            payload = [records]
            dist.broadcast_object_list(payload, src=0, group=self.group)
            if not self.is_main:
                self._apply_records(payload[0])
        if flags[_STOP] and not run.stop_decision.is_set():
            reason = _REASONS[int(flags[_STOP])] or "session"
            run.stop_decision.set(reason, save=not flags[_NOSAVE])
            if not run.stop_request.is_set():  # this rank's own request now says why it stopped
                run.stop_request.set(reason, save=not flags[_NOSAVE])
        if control is not None:  # (an agreed stop is the stop gate's, right after this one)
            if flags[_SAVE]:
                control.should_save = True
            if flags[_EVAL]:
                control.should_evaluate = True
        self.paused = bool(flags[_PAUSE]) and not run.stop_decision.is_set()
        if flags[_EVERY]:
            self.every = int(flags[_EVERY])

    def _apply_records(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            for key, value in edit_changes(record).items():  # not its step, time or reason
                apply_edit(self.run, key, value)
            self.run.workbench_state.live_edits.append(dict(record))

    def exchange_point(self, control) -> None:
        """At exchange points: act on the last agreement, then ask for the next one."""
        self._since += 1
        if self._since < self.every:
            return
        self._since_point, self._since = self._since, 0
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._apply(self._flags, control)
        if self.paused or self.run.stop_decision.is_set():
            return  # nothing in flight while paused or stopping: heartbeats take over
        self._post_next = True

    def start_exchange(self) -> None:
        """Start a pending exchange right after the gradients' all-reduce: every rank has just
        left that sync point, so this one completes at once instead of keeping a gloo thread
        busy-waiting beside the compute for a rank that is a little behind."""
        import torch.distributed as dist

        if not self._post_next:
            return
        self._post_next = False
        self._fill(self._flags, pause=self.pause_wanted())
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for an exchange still in flight when training ends (its requests lapse)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.paused = False
        self.every, self._since, self._since_point, self._last_point = 1, 0, 0, None
        self._post_next = True

    def heartbeat(self, paused: bool, action: str = "", order: dict[str, Any] | None = None) -> tuple[bool, list[str]]:
        """One blocking exchange while paused: (still paused, actions every rank runs now).

        The actions are rank 0's paused-time ``action`` plus saves / evaluations requested
        just before the pause began (they could no longer wait for a step end). A fork's
        action comes with rank 0's ``order``, broadcast to ``self.order`` on every rank.
        """
        import torch.distributed as dist

        flags = self._flags
        self._fill(flags, pause=paused, action=action, at_step=False)
        self._last_point = None  # time spent paused says nothing about step times
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self._apply(flags)
        agreed = _ACTIONS[int(flags[_ACTION])]
        if agreed in FORK_ACTIONS:
            payload = [order]
            dist.broadcast_object_list(payload, src=0, group=self.group)
            self.order = payload[0]
        actions = [agreed] if agreed else []
        actions += [kind for index, kind in ((_SAVE, "save"), (_EVAL, "evaluate")) if flags[index]]
        return self.paused, actions

    def follow_pause(self, run_action: Callable[[str], Any]) -> None:
        """On ranks other than 0: wait out rank 0's pause, joining its paused-time actions."""
        if self.is_main or not self.paused:
            return
        while True:
            still, actions = self.heartbeat(False)
            for action in actions:
                run_action(action)
            if not still:
                break
