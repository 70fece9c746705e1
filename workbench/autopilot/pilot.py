"""The Autopilot: policies steering a run within limits, as a client of its door.

It reads what any front-end reads (``events_since`` with a cursor, ``snapshot``) and acts
through ``set(..., reason=...)`` only, so it works the same on a local Session and on a run
attached to (``workbench.attach``), and costs the training loop nothing: it polls in its own
thread (``start``), or wherever ``step()`` is called.

Every decision is kept (``decisions``): a change the limits refuse is recorded with its
one-line reason and never sent; a change sent is a live edit whose reason names the
autopilot and the policy (``autopilot/plateau: eval_loss ... has not improved ...``). In
dry-run mode a change is only *proposed*, and the proposal is put on the run itself
(``session.propose``, run_proposals.py): every front-end on the run lists it, in any process,
and whoever is attached accepts or rejects it there; the autopilot follows that decision (an
accepted proposal is its change sent). ``accept(id)`` and ``reject(id)`` decide it from here,
on the run too. With ``revert_after=W``, a
change is watched for W evaluations; if the watched metric is then worse than before it by
more than ``revert_margin`` (relative), the change is undone (``revert: ...``), and while
one is watched, the policies' new changes are held so each is judged alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from workbench.autopilot.limits import Action, Limits, describe_changes
from workbench.autopilot.policies import Observation, Policy, metric_values
from workbench.autopilot.run_proposals import RunProposals
from workbench.core.edits import MAX_REASON
from workbench.core.schedule_edits import parse_schedule
from workbench.door.protocol import SessionLike
from workbench.door.values import ENDED

__all__ = ["Autopilot", "Decision", "DECISION_STATES"]

log = logging.getLogger("workbench.autopilot")

# What became of a decision. "proposed": waiting for a person (dry run); "sent": the run has
# it (sent, or a proposal accepted); "applied": the run made it (a live edit); "refused":
# outside the limits, never sent; "held": a change was being watched, never sent; "failed":
# the run refused it; "rejected": a person said no; "superseded": a newer proposal of the same
# policy took its place.
DECISION_STATES = ("proposed", "sent", "applied", "refused", "held", "failed", "rejected", "superseded")


@dataclass(frozen=True)
class Decision:
    """One decision of the autopilot: a change a policy asked for (or a revert), and its fate."""

    id: int
    step: int
    policy: str
    changes: Mapping[str, Any]
    reason: str
    state: str
    note: str | None = None  # why refused, held or failed; what the run applied
    kind: str = "change"  # or "revert"
    reverts: int | None = None  # the decision a revert undoes
    sent: str | None = None  # the reason as sent, and as the run records it with the edit
    applied: Mapping[str, Any] | None = None  # what the run applied (set()'s answer)
    time: float = field(default_factory=time.time)
    published: int | None = None  # the run's id of this proposal (session.propose), when it has one

    @property
    def change_text(self) -> str:
        """The change as a short phrase (``lr_scale=0.5``, ``decay_now steps=200 ...``)."""
        return describe_changes(self.changes)

    def line(self) -> str:
        """The decision as one line, for logs and the front-ends."""
        note = f" ({self.note})" if self.note and self.state in ("refused", "held", "failed") else ""
        return f"#{self.id} step {self.step} {self.policy}: {self.change_text} [{self.state}]{note}: {self.reason}"


def _not_a_proposal(decision: Decision) -> str:
    """The one-line refusal to decide a decision that no longer waits; a replaced proposal names
    its successor, the one to decide now (a policy re-proposes at each evaluation it still sees a
    reason to)."""
    if decision.state == "superseded":
        return (f"autopilot: proposal #{decision.id} was {decision.note or 'replaced by a newer one'} "
                f"(a newer evaluation); decide that one (pilot.proposals() lists what waits)")
    return f"autopilot: decision #{decision.id} is {decision.state}, not a proposal"


@dataclass
class _Watch:
    """A change under watch: the metric before it and the evaluations since."""

    decision: int
    sent_step: int
    baseline: float
    inverse: dict[str, Any] | Callable[[], dict[str, Any] | None] | None
    seen: list[float] = field(default_factory=list)


class Autopilot(RunProposals):
    """Run ``policies`` against ``session`` (any SessionLike) within ``limits``.

    ``dry_run``: only propose (``proposals()``, ``accept``, ``reject``; each proposal is also
    put on the run, for anyone attached to decide, when the session has ``propose``).
    ``watch``/``mode``: the evaluation metric a change is judged by (lower is better unless ``mode="max"``);
    ``revert_after``: evaluations to watch a change for (0: never revert); ``revert_margin``:
    how much worse (a fraction of the value before) counts as worse. ``interval``: seconds
    between polls of ``start()``'s thread. ``name`` starts each reason sent.
    """

    def __init__(self, session: SessionLike, policies: Policy | Sequence[Policy], limits: Limits, *,
                 dry_run: bool = False, watch: str = "eval_loss", mode: str = "min", revert_after: int = 0,
                 revert_margin: float = 0.0, interval: float = 0.5, name: str = "autopilot") -> None:
        if not isinstance(limits, Limits):
            raise TypeError(f"limits: expected workbench.autopilot.Limits, got {type(limits).__name__}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode: expected 'min' or 'max', got {mode!r}")
        if isinstance(revert_after, bool) or not isinstance(revert_after, int) or revert_after < 0:
            raise ValueError(f"revert_after: expected a whole number of evaluations >= 0, got {revert_after!r}")
        self.session = session
        self.policies: list[Policy] = [policies] if isinstance(policies, Policy) else list(policies)
        self.limits = limits
        self.dry_run = dry_run
        self.watch, self.mode, self.revert_after, self.revert_margin = watch, mode, revert_after, revert_margin
        self.interval = interval
        self.name = name
        self.error: str | None = None  # the last poll's failure (the thread goes on)
        self.version = 0  # bumped on every change of the decisions: front-ends redraw on it
        self._decisions: list[Decision] = []
        self._actions: dict[int, tuple[Policy, Action]] = {}
        self._watches: list[_Watch] = []
        self._published: dict[int, int] = {}  # the run's proposal id -> the decision it is
        self._inverses: dict[int, Any] = {}  # a published change's undo, taken when it was proposed
        self._latest: float | None = None  # the watched metric's newest value
        self._step = 0
        self._ended = False  # the run had ended at the last poll
        self._cursor = 0
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what it decided ---------------------------------------------------------------------

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first."""
        with self._lock:
            return tuple(self._decisions)

    def proposals(self) -> tuple[Decision, ...]:
        """The proposals waiting for a person (dry run), oldest first."""
        return tuple(d for d in self.decisions if d.state == "proposed")

    def applied(self) -> tuple[Decision, ...]:
        """The decisions the run made (live edits), oldest first."""
        return tuple(d for d in self.decisions if d.state == "applied")

    # -- polling --------------------------------------------------------------------------------

    def step(self) -> list[Decision]:
        """One poll: read the new events and the snapshot, judge watched changes, ask each
        policy, and act on (or propose) what it asks; returns the decisions made."""
        events, cursor = self.session.events_since(self._cursor)
        snapshot = self.session.snapshot()
        made: list[Decision] = []
        with self._lock:
            self._cursor, self._step, self._ended = cursor, snapshot.step, snapshot.status in ENDED
        # Proposals decided on the run (by anyone attached) first: an accepted one counts
        # against the limits before the policies ask again.
        for event in events:
            if event.kind == "proposal_decided":
                self._follow(event.data, event.step)
        with self._lock:
            for step, value in metric_values(tuple(events), self.watch):
                made.extend(self._judge(step, value))
                self._latest = value
        # Reverts due go out (or are proposed on the run) here, outside the lock (a remote call may take a while).
        made = [self._send(d.id) if d.state == "sent" else self._publish(d.id) if d.state == "proposed" else d
                for d in made]
        seen = Observation(snapshot.step, tuple(events), snapshot, self.limits)
        for policy in self.policies:
            action = policy.observe(seen)
            if action is not None:
                made.append(self._decide(policy, action, snapshot.step))
        return made

    def start(self) -> "Autopilot":
        """Poll every ``interval`` seconds in a thread of its own until the run ends or ``stop()``."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping.clear()
                self._thread = threading.Thread(target=self._loop, name="workbench-autopilot", daemon=True)
                self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling (proposals stay; a change already sent stays sent)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, timeout: float | None = None) -> tuple[Decision, ...]:
        """Poll in this thread until the run ends (or ``timeout`` seconds); returns the decisions."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._stopping.clear()
        while not self._poll_once() and (deadline is None or time.monotonic() < deadline):
            if self._stopping.wait(self.interval):
                break
        return self.decisions

    def _loop(self) -> None:
        while not self._poll_once():
            if self._stopping.wait(self.interval):
                break

    def _poll_once(self) -> bool:
        """One step(); True once the run has ended."""
        try:
            self.step()
            self.error = None
            return self._ended
        except Exception as exc:  # noqa: BLE001 - a bad reply or a policy's bug: said, tried again
            text = f"{type(exc).__name__}: {exc}"
            if text != self.error:
                log.warning("autopilot: %s", text)
            self.error = text
            return False

    # -- a person's answer (dry run) ----------------------------------------------------------------

    def accept(self, decision_id: int) -> Decision:
        """Send a proposal (checked against the limits again, now); returns its decision. A
        proposal on the run is accepted there (the edit's reason: ``accepted proposal N from
        autopilot/POLICY: ...``); one the run does not have is sent with "(accepted)" in its reason."""
        with self._lock:
            decision = self._proposal(decision_id)
            problem = None if decision.kind == "revert" else (
                self.limits.check(decision.changes) or self.limits.check_rate(self._step, self._change_steps()))
            if problem:
                self._update(decision.id, state="refused", note=problem)
                self._declined(decision.id, problem)
            elif decision.published is None:
                self._update(decision.id, state="sent", step=self._step, note="accepted")
        if problem:
            if decision.published is not None:  # the run's copy must not wait for anyone
                self._withdraw(decision.published, problem)
            return self._get(decision.id)
        if decision.published is None:
            return self._send(decision.id)
        self._decide_on_run(decision.id, decision.published, True, None)
        return self._get(decision.id)

    def reject(self, decision_id: int, why: str | None = None) -> Decision:
        """Drop a proposal (nothing is sent); the run's copy is rejected too. One replaced by a
        newer proposal before the call is refused (its line names the newer one); one replaced
        while the run heard the rejection is returned as replaced: nothing of it is applied."""
        with self._lock:
            decision = self._proposal(decision_id)
        if decision.published is not None:
            self._decide_on_run(decision.id, decision.published, False, why)
        with self._lock:
            decision = self._get(decision_id)
            if decision.state == "superseded":  # replaced while the run heard the no: applied neither way
                return decision
            if decision.state not in ("proposed", "rejected"):  # decided otherwise on the run meanwhile
                raise ValueError(_not_a_proposal(decision))
            note = why or "rejected"
            if decision.state == "proposed":
                self._declined(decision.id, note)
            self._update(decision.id, state="rejected", note=note)
            return self._get(decision.id)

    def _proposal(self, decision_id: int) -> Decision:
        decision = self._get(decision_id)
        if decision.state != "proposed":
            raise ValueError(_not_a_proposal(decision))
        return decision

    # -- deciding and sending ---------------------------------------------------------------------

    def _decide(self, policy: Policy, action: Action, step: int) -> Decision:
        name = getattr(policy, "name", type(policy).__name__)
        changes = dict(action.changes) if isinstance(action.changes, Mapping) else {}
        with self._lock:
            problem = self.limits.check(changes) or self.limits.check_rate(step, self._change_steps())
            state = "refused" if problem else "proposed" if self.dry_run else "sent"
            if not problem and self._watches and self.revert_after:
                watch = self._watches[0]
                state, problem = "held", (f"held: change #{watch.decision} is being watched "
                                          f"({len(watch.seen)} of {self.revert_after} evaluations)")
            superseded = []  # the run's copies of the proposals replaced, withdrawn once outside the lock
            if state == "proposed":  # a newer proposal of the same policy replaces a waiting one
                for old in self._decisions:
                    if old.state == "proposed" and old.policy == name and old.kind == "change":
                        self._update(old.id, state="superseded", note=f"replaced by #{len(self._decisions) + 1}")
                        superseded += [old.published] if old.published is not None else []
            decision = self._add(Decision(len(self._decisions) + 1, step, name, changes, str(action.reason),
                                          state, note=problem))
            self._actions[decision.id] = (policy, action)
            if problem:
                self._declined(decision.id, problem)
        log.info("autopilot: %s", decision.line())
        if state == "proposed":
            return self._publish(decision.id, superseded)
        return self._send(decision.id) if state == "sent" else decision

    def _send(self, decision_id: int) -> Decision:
        """Send a decision in state "sent" to the run (outside the lock: a remote call may take a while)."""
        with self._lock:
            decision = self._get(decision_id)
        inverse = self._inverse(decision.changes) if decision.kind == "change" and self.revert_after else None
        reason = f"{self.name}/{decision.policy}: {decision.reason}"
        if decision.note == "accepted":
            reason = f"{self.name}/{decision.policy} (accepted): {decision.reason}"
        if len(reason) > MAX_REASON:
            reason = reason[:MAX_REASON - 3] + "..."
        with self._lock:
            self._update(decision_id, sent=" ".join(reason.split()))  # one line, as the run keeps it
        try:
            result = self.session.set(reason=reason, **decision.changes)
        except (ValueError, RuntimeError) as exc:
            return self._settled(decision_id, error=str(exc))
        with self._lock:
            if decision.kind == "change" and self.revert_after and self._latest is not None:
                self._watches.append(_Watch(decision_id, decision.step, self._latest, inverse))
        if isinstance(result, Future):
            result.add_done_callback(lambda done: self._settled(
                decision_id, error=str(done.exception()) if done.exception() else None,
                applied=None if done.exception() else done.result()))
            return self._get(decision_id)
        return self._settled(decision_id, applied=result)

    def _settled(self, decision_id: int, error: str | None = None, applied: Any = None) -> Decision:
        """The run's answer to a change sent: applied (a live edit), or refused with its line."""
        with self._lock:
            if error is not None:
                self._update(decision_id, state="failed", note=error.splitlines()[0] if error else "failed")
                self._watches = [w for w in self._watches if w.decision != decision_id]
                self._declined(decision_id, error)
            else:
                self._update(decision_id, state="applied", note=describe_changes(applied or {}),
                             applied=dict(applied or {}))
            decision = self._get(decision_id)
        log.info("autopilot: %s", decision.line())
        return decision

    def _declined(self, decision_id: int, note: str) -> None:
        policy, action = self._actions.get(decision_id, (None, None))
        hook = getattr(policy, "declined", None)
        if hook is not None and action is not None:
            hook(action, note)

    # -- watching and reverting ---------------------------------------------------------------------

    def _worse(self, value: float, baseline: float) -> bool:
        margin = abs(baseline) * self.revert_margin
        return value > baseline + margin if self.mode == "min" else value < baseline - margin

    def _judge(self, step: int, value: float) -> list[Decision]:
        """Count an evaluation against every change under watch; revert those found worse."""
        made = []
        for watch in list(self._watches):
            if step <= watch.sent_step:
                continue  # evaluated before the change reached the run
            watch.seen.append(value)
            if len(watch.seen) < self.revert_after:
                continue
            self._watches.remove(watch)
            original = self._get(watch.decision)
            if original.state not in ("applied", "sent") or not self._worse(value, watch.baseline):
                continue
            why = (f"revert #{original.id} ({original.change_text}): {self.watch} {value:.4g} after "
                   f"{self.revert_after} evaluations is worse than {watch.baseline:.4g} before it")
            inverse = watch.inverse() if callable(watch.inverse) else watch.inverse
            if inverse is None:
                made.append(self._add(Decision(len(self._decisions) + 1, step, original.policy, {}, why, "refused",
                                               note=f"{original.change_text} cannot be undone", kind="revert",
                                               reverts=original.id)))
                continue
            state = "proposed" if self.dry_run else "sent"
            decision = self._add(Decision(len(self._decisions) + 1, step, original.policy, inverse, why, state,
                                          kind="revert", reverts=original.id))
            made.append(decision)  # step() sends it, outside the lock
        return made

    def _inverse(self, changes: Mapping[str, Any]) -> dict[str, Any] | Callable[[], dict[str, Any] | None] | None:
        """The edit that undoes ``changes`` (or a function that finds it when the revert is
        due), or None when it cannot be undone exactly (a cooldown, an extension or a rewarm
        reshape the schedule from the step they start at)."""
        if set(changes) == {"lr_scale"}:
            return {"lr_scale": 1.0 / float(changes["lr_scale"])}
        if set(changes) == {"schedule"}:
            change = parse_schedule(changes["schedule"])
            if change["op"] == "scale_peak":
                return {"schedule": {"op": "scale_peak", "factor": 1.0 / float(change["factor"])}}
            return None
        if set(changes) == {"max_steps"}:
            return {"max_steps": int(self.session.snapshot().max_steps)}
        if set(changes) == {"learning_rate"}:
            # The base rate is not published, but the plan is: the planned rate before the
            # change over the planned rate after it is the factor that undoes it.
            before = dict(self.session.lr_plan())

            def undo() -> dict[str, Any] | None:
                for step, rate in self.session.lr_plan():
                    if rate > 0 and before.get(step, 0.0) > 0:
                        return {"lr_scale": before[step] / rate}
                return None
            return undo
        return None

    # -- bookkeeping --------------------------------------------------------------------------------

    def _watch(self, decision_id: int, step: int, inverse: Any) -> _Watch:
        """A change to watch from ``step``, judged against the watched metric's newest value."""
        return _Watch(decision_id, step, self._latest if self._latest is not None else math.nan, inverse)

    def _change_steps(self) -> list[int]:
        """The steps of the changes made or under way (reverts excluded): what the rate limit counts."""
        return [d.step for d in self._decisions if d.kind == "change" and d.state in ("sent", "applied")]

    def _add(self, decision: Decision) -> Decision:
        self._decisions.append(decision)
        self.version += 1
        return decision

    def _get(self, decision_id: int) -> Decision:
        if not isinstance(decision_id, int) or not 1 <= decision_id <= len(self._decisions):
            raise ValueError(f"autopilot: no decision #{decision_id}")
        return self._decisions[decision_id - 1]

    def _update(self, decision_id: int, **fields: Any) -> None:
        self._decisions[decision_id - 1] = replace(self._decisions[decision_id - 1], **fields)
        self.version += 1

    def __repr__(self) -> str:
        mode = "dry run" if self.dry_run else "acting"
        names = ", ".join(getattr(p, "name", type(p).__name__) for p in self.policies)
        return f"Autopilot({names}; {mode}; {len(self._decisions)} decisions)"

