"""A dry-run autopilot's proposals, put on the run itself (issue 28).

An autopilot may run in another process than the people who decide (an agent over
``workbench.attach``, a dashboard elsewhere, ``workbench ctl``), so in dry-run mode each
proposal is published to the run (``session.propose``, when the SessionLike has it) and
decided there by anyone attached (``session.decide``). The autopilot follows those decisions
in the events it reads anyway (``proposal_decided``): an accepted proposal is its change sent
(the limits count it, a revert watch starts), a rejected one is dropped, and once the run
applied or refused the edit the decision settles as a change sent by the autopilot does. Its
own ``accept`` and ``reject`` decide on the run too, so every way of deciding is one path,
and the run's record says who decided (``accepted proposal 3 from autopilot/plateau: ...``).

A mixin of :class:`workbench.autopilot.pilot.Autopilot`: it uses the autopilot's lock,
decisions and watches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.core.edits import MAX_REASON
from workbench.door.proposals import MAX_SOURCE, accepted_reason

__all__ = ["RunProposals", "proposal_event"]

log = logging.getLogger("workbench.autopilot")


def proposal_event(proposal: Any) -> dict[str, Any]:
    """A Proposal as the data of its ``proposal_decided`` event (what ``_follow`` reads)."""
    return {"id": proposal.id, "state": proposal.state, "by": proposal.decided_by, "decision": proposal.decision,
            "note": proposal.note, "applied": proposal.applied}


def _one_line(reason: str) -> str:
    """A policy's reason as the run keeps a proposal's: one line, at most MAX_REASON characters."""
    text = " ".join(str(reason).split())
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


class RunProposals:
    """Publishing proposals to the run, and following what is decided there (mixed into Autopilot)."""

    def _source(self, policy: str) -> str:
        """Who proposes, as the run records it: ``autopilot/plateau``."""
        return f"{self.name}/{policy}"[:MAX_SOURCE]

    def _publish(self, decision_id: int, superseded: Sequence[int] = ()) -> Any:
        """Put proposal ``decision_id`` on the run (``session.propose``) so whoever is attached
        decides it, and withdraw the run's proposals it replaces. Without ``propose`` (or when
        the run refuses the proposal, e.g. an older run) it stays here, for accept()/reject()."""
        for published in superseded:
            self._withdraw(published, f"superseded by the autopilot's #{decision_id}")
        propose = getattr(self.session, "propose", None)
        with self._lock:
            decision = self._get(decision_id)
        if propose is None or decision.state != "proposed":
            return decision
        # The undo, taken now: once a person accepts, the run has changed already (max_steps, the plan).
        inverse = self._inverse(decision.changes) if decision.kind == "change" and self.revert_after else None
        reason = _one_line(decision.reason)
        try:
            published = int(propose(dict(decision.changes), reason=reason, source=self._source(decision.policy)))
        except Exception as exc:  # noqa: BLE001 - an older run or a refusal: the proposal stays here, said once
            log.warning("autopilot: #%d stays a proposal of this process only: %s", decision_id, exc)
            return decision
        with self._lock:
            decision = self._get(decision_id)
            if decision.state == "proposed":
                self._update(decision_id, published=published)
                self._published[published] = decision_id
                self._inverses[decision_id] = inverse
                return self._get(decision_id)
        # Decided here while the run was being asked: the run's copy must not wait for anyone.
        self._withdraw(published, f"{decision.state} before the run had it")
        return decision

    def _withdraw(self, published: int, why: str) -> None:
        """Reject the run's proposal ``published`` (the autopilot took it back)."""
        try:
            self.session.decide(published, False, reason=why)
        except Exception as exc:  # noqa: BLE001 - decided meanwhile: its event says what became of it
            log.debug("autopilot: proposal %d could not be withdrawn: %s", published, exc)

    def _run_proposal(self, published: int) -> Any:
        """The run's proposal ``published`` as the run now has it, or None."""
        try:
            return next((p for p in self.session.proposals() if p.id == published), None)
        except Exception:  # noqa: BLE001 - unreadable now: the events will tell
            return None

    def _decide_on_run(self, decision_id: int, published: int, accept: bool, why: str | None) -> None:
        """Decide the run's copy of a proposal; when the run refuses because it was decided
        already (or the change failed), follow what it has instead. ValueError with one line
        when the run neither took the decision nor has one."""
        try:
            proposal = self.session.decide(published, accept, reason=why)
        except (ValueError, RuntimeError) as exc:
            proposal = self._run_proposal(published)
            if proposal is None or proposal.pending:
                raise ValueError(f"autopilot: #{decision_id}: {exc}") from None
        self._follow(proposal_event(proposal), proposal.decided_step or self._step)

    def _follow(self, data: Mapping[str, Any], step: int) -> None:
        """A decision about one of this autopilot's published proposals, made on the run (by
        anyone, here or elsewhere): ``data`` as a ``proposal_decided`` event carries it.
        Idempotent: the same decision seen twice (its event, the answer to decide()) counts once."""
        decision_id = self._published.get(data.get("id"))  # type: ignore[arg-type] - any id from the events
        if decision_id is None:
            return
        state, by = data.get("state"), data.get("by") or "someone"
        with self._lock:
            decision = self._get(decision_id)
            if state == "rejected":
                if decision.state == "proposed":
                    note = data.get("decision") or f"rejected by {by}"
                    self._update(decision_id, state="rejected", note=note)
                    self._declined(decision_id, note)
                return
            if state not in ("accepted", "applied", "failed"):
                return
            if decision.state in ("proposed", "superseded"):  # the run has it now, whoever accepted it
                self._accepted(decision_id, step, by, data.get("decision"))
            settle = self._get(decision_id).state == "sent" and state != "accepted"
        if settle:
            error = (data.get("note") or "failed") if state == "failed" else None
            self._settled(decision_id, error=error, applied=data.get("applied"))

    def _accepted(self, decision_id: int, step: int, by: str, why: str | None) -> None:
        """(the lock held) A published proposal accepted: a change sent, which the limits count
        and, with ``revert_after``, is watched from the step it was accepted at."""
        decision = self._get(decision_id)
        source = self._source(decision.policy)
        self._update(decision_id, state="sent", step=step, note=f"accepted by {by}",
                     sent=accepted_reason(decision.published, source, _one_line(decision.reason), why))
        if decision.kind == "change" and self.revert_after and self._latest is not None:
            self._watches.append(self._watch(decision_id, step, self._inverses.get(decision_id)))
        log.info("autopilot: %s", self._get(decision_id).line())
