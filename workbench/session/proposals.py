"""A Session's proposals (issue 28): changes proposed to the run, decided by anyone attached.

An autopilot in dry-run mode may run in another process (an agent over ``workbench.attach``)
and a person may watch the run from a third (``workbench attach``, a notebook, ``workbench
ctl``): so its proposals live here, in the run, not in the proposer. ``propose`` checks a
change by the rule ``set()`` applies and keeps it (``ProposalBook``: at most MAX_PENDING
waiting, the newest KEPT_DECIDED decided ones besides); the snapshot carries them, so every
front-end lists them; ``decide`` accepts one (applied through ``set()``, a live edit whose
reason names the proposal and its source) or rejects it. Each step is an event, in the event
stream and in events.jsonl (``proposal``, ``proposal_decided``: accepted or rejected, then
applied or failed once the run made the edit), so the proposer hears the answer wherever it
is. Proposals are not saved with checkpoints: they are questions to the people watching this
run, not part of its state.

A mixin of :class:`workbench.session.local.Session`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from workbench.core.edits import check_reason
from workbench.door.callers import caller
from workbench.door.proposals import KEPT_DECIDED, MAX_PENDING, MAX_SOURCE, Proposal, accepted_reason
from workbench.door.values import ENDED

__all__ = ["ProposalBook", "ProposalCommands"]


class ProposalBook:
    """The proposals of one run, bounded: every pending one (at most ``pending_limit``) and
    the newest ``kept`` decided ones. Thread-safe; ``all()`` hands out the same tuple until
    something changes, so a snapshot published ten times a second costs nothing for it."""

    def __init__(self, pending_limit: int = MAX_PENDING, kept: int = KEPT_DECIDED) -> None:
        self.pending_limit, self.kept = pending_limit, kept
        self._lock = threading.Lock()
        self._items: dict[int, Proposal] = {}  # by id, oldest first
        self._next = 1
        self._frozen: tuple[Proposal, ...] | None = ()

    def add(self, source: str, changes: dict[str, Any], reason: str | None, step: int) -> Proposal:
        """Keep a new pending proposal; RuntimeError with one line when too many wait."""
        with self._lock:
            waiting = sum(1 for p in self._items.values() if p.pending)
            if waiting >= self.pending_limit:
                raise RuntimeError(f"propose: {waiting} proposals wait already (at most {self.pending_limit}); "
                                   "accept or reject some first")
            proposal = Proposal(self._next, source, dict(changes), reason, step)
            self._items[proposal.id] = proposal
            self._next += 1
            self._frozen = None
            return proposal

    def get(self, proposal_id: Any, what: str = "decide") -> Proposal:
        """The proposal ``proposal_id``; ValueError with one line when there is none."""
        with self._lock:
            if isinstance(proposal_id, bool) or not isinstance(proposal_id, int) or proposal_id not in self._items:
                known = ", ".join(str(i) for i, p in self._items.items() if p.pending) or "none pending"
                raise ValueError(f"{what}: no proposal {proposal_id!r} (pending: {known})")
            return self._items[proposal_id]

    def update(self, proposal_id: int, **fields: Any) -> Proposal:
        """Change a kept proposal's fields; the oldest decided ones beyond ``kept`` are dropped."""
        with self._lock:
            proposal = self._items[proposal_id] = replace(self._items[proposal_id], **fields)
            decided = [i for i, p in self._items.items() if not p.pending]
            for old in decided[:max(len(decided) - self.kept, 0)]:
                if old != proposal_id:  # the one just decided stays until newer ones push it out
                    del self._items[old]
            self._frozen = None
            return proposal

    def all(self) -> tuple[Proposal, ...]:
        """Every kept proposal, oldest first (the same tuple until one changes)."""
        with self._lock:
            if self._frozen is None:
                self._frozen = tuple(self._items.values())
            return self._frozen


def _source(source: Any) -> str:
    """Who proposes, checked: a short one-line name; the caller's name when none is given."""
    if source is None:
        return caller() or "python"
    if not isinstance(source, str) or not " ".join(source.split()) or len(source) > MAX_SOURCE:
        raise ValueError(f"propose: source: expected a short name such as autopilot/plateau (at most {MAX_SOURCE} "
                         f"characters), got {source!r}"[:300])
    return " ".join(source.split())


class ProposalCommands:
    """``propose``, ``proposals`` and ``decide`` of a Session (mixed into it)."""

    def proposals(self) -> tuple[Proposal, ...]:
        """The run's proposals: every pending one and the newest decided ones, oldest first
        (the snapshot carries the same)."""
        return self._proposal_book.all()

    def propose(self, changes: Mapping[str, Any], reason: str | None = None, source: str | None = None) -> int:
        """Put ``changes`` (live edits, as ``set()`` takes them) on the run for a person to
        accept or reject; nothing is applied. Checked now by the rule set() applies (ValueError
        with one line); kept, published in the snapshot and told as a ``proposal`` event.
        ``source``: who proposes ("autopilot/plateau"; the caller's name by default). Returns
        the proposal's id, which ``decide`` takes."""
        self._require_main("propose")
        if not isinstance(changes, Mapping):
            raise ValueError("propose: expected the changes as a mapping, e.g. {\"lr_scale\": 0.5}")
        checked = self.validate_edits(changes, reason)
        reason, source = check_reason(reason), _source(source)
        with self._lock:
            if self._status in ENDED:
                raise RuntimeError(f"propose: the run is {self._status}; there is nothing left to change")
            proposal = self._proposal_book.add(source, checked, reason, self.trainer.state.global_step)
        self._tell_proposal("proposal", proposal)
        return proposal.id

    def decide(self, proposal_id: int, accept: bool, reason: str | None = None) -> Proposal:
        """Accept or reject pending proposal ``proposal_id``. Accepted, its changes go through
        ``set()`` (checked again, now: a change the run refuses marks it failed and raises that
        line), recorded as a live edit whose reason is ``accepted proposal N from SOURCE:
        REASON``; applied at once when paused, else at the next step end (state "accepted",
        then "applied" or "failed"). ``reason``: why (kept with the decision, and appended to
        the edit's reason). Who decided is the caller: a control client's name, "dashboard",
        "notebook", "python". Returns the proposal as decided."""
        self._require_main("decide")
        if not isinstance(accept, bool):
            raise ValueError(f"decide: accept: expected true or false, got {accept!r}")
        why, by = check_reason(reason), caller() or "python"
        book = self._proposal_book
        # The Session's lock: two people deciding at once decide one after the other, so a
        # proposal is applied once (the second hears it was decided already).
        with self._lock:
            proposal = book.get(proposal_id)
            if not proposal.pending:
                raise RuntimeError(f"decide: proposal {proposal_id} was {proposal.state} already "
                                   f"(by {proposal.decided_by})")
            decided = {"decided_by": by, "decision": why, "decided_step": self.trainer.state.global_step,
                       "decided_time": time.time()}
            if not accept:
                proposal = book.update(proposal.id, state="rejected", **decided)
            else:
                text = accepted_reason(proposal.id, proposal.source, proposal.reason, why)
                try:
                    result = self.set(reason=text, **proposal.changes)
                except (ValueError, RuntimeError) as exc:
                    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    failed = book.update(proposal.id, state="failed", note=line, **decided)
                    self._tell_proposal("proposal_decided", failed)
                    raise type(exc)(f"decide: proposal {proposal.id} could not be applied: {line}") from None
                if isinstance(result, Future):  # lands at the next step end
                    proposal = book.update(proposal.id, state="accepted", **decided)
                else:
                    proposal = book.update(proposal.id, state="applied", applied=dict(result), **decided)
            # Told before the edit can settle (its callback is added after), so "accepted" always
            # comes before "applied" in every reader's stream.
            self._tell_proposal("proposal_decided", proposal)
            if accept and isinstance(result, Future):
                result.add_done_callback(lambda done, ident=proposal.id: self._proposal_settled(ident, done))
        return proposal

    def _proposal_settled(self, proposal_id: int, done: Future) -> None:
        """An accepted proposal's edit reached the run (the training thread): applied, or refused."""
        error = done.exception()
        if error is not None:
            proposal = self._proposal_book.update(proposal_id, state="failed",
                                                  note=(str(error).splitlines() or [type(error).__name__])[0])
        else:
            proposal = self._proposal_book.update(proposal_id, state="applied", applied=dict(done.result() or {}))
        self._tell_proposal("proposal_decided", proposal)

    def _tell_proposal(self, kind: str, proposal: Proposal) -> None:
        """A proposal made or decided: an event (the stream and events.jsonl) and a snapshot."""
        data: dict[str, Any] = {"id": proposal.id, "source": proposal.source, "changes": dict(proposal.changes),
                                "reason": proposal.reason}
        if kind == "proposal_decided":
            data.update(state=proposal.state, by=proposal.decided_by, decision=proposal.decision)
            if proposal.note is not None:
                data["note"] = proposal.note
            if proposal.applied is not None:
                data["applied"] = dict(proposal.applied)
        self._log_event(kind, **data)
        self._emit(kind, **data)
        self._publish()
