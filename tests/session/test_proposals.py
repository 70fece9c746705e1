"""A run's proposals (issue 28): changes proposed to the run itself, decided by anyone.

Each test steers a real Session on the small MLP. A proposal is checked by the rule set()
applies, kept (bounded), published in the snapshot and told as events (the stream and
events.jsonl); accepting it applies it through set() as a live edit whose reason names the
proposal, rejecting it changes nothing; a bad id, a bad change or a second decision is
refused with one line.
"""

from __future__ import annotations

import pytest

from workbench.core.event_file import read_events
from workbench.door.callers import calling_as
from workbench.door.proposals import KEPT_DECIDED, MAX_PENDING, Proposal, accepted_reason
from workbench.session.proposals import ProposalBook

from support import DEADLINE, finish, wait_until
from support.sessions import running


def edits(session) -> list[dict]:
    return list(session.trainer.workbench_state.live_edits)


def test_a_proposal_is_published_and_accepting_it_applies_it_as_an_edit_naming_it(tmp_path, sessions):
    out = tmp_path / "run"
    session = running(out, sessions)
    ident = session.propose({"lr_scale": "0.5"}, reason="eval  loss flat\nfor 3 evaluations", source="agent/plateau")
    (proposal,) = session.proposals()
    assert proposal.id == ident == 1 and proposal.pending and proposal.changes == {"lr_scale": 0.5}
    assert proposal.reason == "eval loss flat for 3 evaluations" and proposal.source == "agent/plateau"
    assert session.snapshot().proposals == (proposal,) and edits(session) == []  # nothing changed yet
    events = [e for e in session.events_since(0)[0] if e.kind == "proposal"]
    assert events and events[0].data["id"] == 1 and events[0].data["changes"] == {"lr_scale": 0.5}

    with calling_as("dashboard"):  # who decides is the caller: the record names it
        decided = session.decide(ident, True, reason="looks right")
    assert decided.state in ("accepted", "applied") and decided.decided_by == "dashboard"
    wait_until(lambda: session.proposals()[0].state == "applied", "the edit to land")
    (made,) = edits(session)
    assert made["lr_scale"] == 0.5
    assert made["reason"] == "accepted proposal 1 from agent/plateau: eval loss flat for 3 evaluations; looks right"
    assert made["reason"] == accepted_reason(1, "agent/plateau", proposal.reason, "looks right")
    assert session.snapshot().proposals[0].applied == {"lr_scale": 0.5}
    with pytest.raises(RuntimeError, match=r"^decide: proposal 1 was applied already \(by dashboard\)$"):
        session.decide(ident, False)

    # A rejected one changes nothing; the source defaults to the caller ("python" in-process).
    second = session.propose({"max_steps": 100_000 - 1})
    rejected = session.decide(second, False, reason="not now")
    assert (rejected.state, rejected.decision, rejected.source) == ("rejected", "not now", "python")
    assert len(edits(session)) == 1
    session.stop(save=False)
    finish(session)
    records = [(r["event"], r["id"], r.get("state")) for r in read_events(out) if r["event"].startswith("proposal")]
    assert records == [("proposal", 1, None), ("proposal_decided", 1, "accepted"), ("proposal_decided", 1, "applied"),
                       ("proposal", 2, None), ("proposal_decided", 2, "rejected")]
    kinds = [e.kind for e in session.events_since(0)[0]]
    assert kinds.count("proposal") == 2 and kinds.count("proposal_decided") == 3


def test_bad_ids_changes_and_states_are_refused_with_one_line(tmp_path, sessions):
    session = running(tmp_path / "run", sessions)
    for changes, said in [({"weight_decay": 0.1}, "weight_decay"), ({}, "nothing to change"),
                          ({"lr_scale": -1}, "lr_scale"), ({"learning_rate": 1e-3, "lr_scale": 0.5}, "not both")]:
        with pytest.raises(ValueError, match=said) as refused:
            session.propose(changes)
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="source"):
        session.propose({"lr_scale": 0.5}, source="x" * 200)
    with pytest.raises(ValueError, match="reason"):
        session.propose({"lr_scale": 0.5}, reason=["not", "text"])
    with pytest.raises(ValueError, match=r"^decide: no proposal 7 \(pending: none pending\)$"):
        session.decide(7, True)
    ident = session.propose({"lr_scale": 0.5})
    with pytest.raises(ValueError, match=r"^decide: no proposal '1' \(pending: 1\)$"):
        session.decide("1", True)  # type: ignore[arg-type] - what a sloppy client sends
    with pytest.raises(ValueError, match="accept: expected true or false"):
        session.decide(ident, "yes")  # type: ignore[arg-type]
    assert session.proposals()[0].pending and edits(session) == []
    session.stop(save=False)
    finish(session)
    with pytest.raises(RuntimeError, match="^propose: the run is stopped"):
        session.propose({"lr_scale": 0.5})


def test_paused_it_applies_at_once_and_a_change_the_run_now_refuses_fails(tmp_path, sessions):
    session = running(tmp_path / "run", sessions)
    session.pause(wait=True, timeout=DEADLINE)
    step = session.snapshot().step
    soon = session.propose({"max_steps": step + 1}, reason="stop soon", source="agent")
    half = session.propose({"lr_scale": 0.5}, source="agent")
    applied = session.decide(half, True)  # paused: set() applies it in this call
    assert applied.state == "applied" and applied.applied == {"lr_scale": 0.5} and len(edits(session)) == 1
    session.resume()
    wait_until(lambda: session.snapshot().step > step + 2, "the run to move past the proposed max_steps")
    session.pause(wait=True, timeout=DEADLINE)
    with pytest.raises(ValueError, match=r"^decide: proposal 1 could not be applied: max_steps: \d+ is below"):
        session.decide(soon, True)
    failed = session.proposals()[0]
    assert failed.state == "failed" and failed.note.startswith("max_steps:") and len(edits(session)) == 1
    assert session.events_since(0)[0][-1].data["state"] == "failed"
    session.resume()


def test_the_book_is_bounded():
    book = ProposalBook()
    for i in range(MAX_PENDING):
        book.add("agent", {"lr_scale": 0.5}, f"#{i}", i)
    with pytest.raises(RuntimeError, match=f"^propose: {MAX_PENDING} proposals wait already"):
        book.add("agent", {"lr_scale": 0.5}, None, 0)
    kept = book.all()
    assert book.all() is kept, "the same tuple until something changes: snapshots stay cheap"
    for proposal in kept:
        book.update(proposal.id, state="rejected")
    assert book.all() is not kept and len(book.all()) == KEPT_DECIDED
    assert [p.id for p in book.all()] == list(range(MAX_PENDING - KEPT_DECIDED + 1, MAX_PENDING + 1))
    assert book.add("agent", {"lr_scale": 0.5}, None, 0).id == MAX_PENDING + 1  # ids are never reused
    again = Proposal.from_dict({**book.all()[0].to_dict(), "from_a_newer_run": True})
    assert again == book.all()[0]
