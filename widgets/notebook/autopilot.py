"""The panel's Autopilot tab: the run's proposals, and an autopilot's in this kernel (issue 28).

A run keeps the changes proposed to it (``snapshot().proposals``): an autopilot in dry-run
mode in any process puts its proposals there, a script or ``workbench ctl`` too. This tab
lists them on any run, local or attached, and lets a person pick a waiting one and Accept it
(the run applies it as a live edit naming the proposal) or Reject it, through the door's
``decide``. With an Autopilot (workbench.autopilot) steering from this kernel
(``Panel(session, autopilot=...)``), its policies, limits and decisions are shown too, and
its proposals are decided through its own ``accept`` and ``reject`` (which check its limits
again and decide the run's copy). The tab decides nothing itself.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

from workbench.door.callers import calling_as
from workbench.door.values import Proposal

__all__ = ["AutopilotTab", "decisions_html", "proposals_html"]

# Panel is typed Any here: panel.py imports this module.
Panel = Any

_COLORS = {"proposed": "#b58900", "pending": "#b58900", "applied": "#2e7d32", "refused": "#c62828",
           "failed": "#c62828", "held": "#777777", "rejected": "#777777", "superseded": "#777777", "sent": "#1565c0",
           "accepted": "#1565c0"}


def decisions_html(decisions: Any) -> str:
    """The decisions as an HTML table, newest first: number, step, policy, change, state, reason."""
    if not decisions:
        return "<i>no decisions yet: the autopilot acts (or proposes) when a policy asks</i>"
    rows = []
    for d in reversed(decisions):
        change = html.escape(d.change_text + (" (revert)" if d.kind == "revert" else ""))
        note = f"<br><small>{html.escape(d.note)}</small>" if d.note and d.state in ("refused", "held", "failed") else ""
        color = _COLORS.get(d.state, "#000000")
        rows.append(f"<tr><td>#{d.id}</td><td>{d.step}</td><td>{html.escape(d.policy)}</td><td>{change}</td>"
                    f"<td style='color:{color}'><b>{d.state}</b></td><td>{html.escape(d.reason)}{note}</td></tr>")
    head = "<tr><th>#</th><th>step</th><th>policy</th><th>change</th><th>state</th><th>reason</th></tr>"
    return f"<table class='workbench-autopilot'>{head}{''.join(rows)}</table>"


def proposals_html(proposals: Any) -> str:
    """The run's proposals as an HTML table, newest first: id, step, source, change, state, reason."""
    if not proposals:
        return ("<i>no proposals on the run: an autopilot in dry-run mode (in any process), a script "
                "(<code>session.propose</code>) or <code>workbench ctl</code> puts them here</i>")
    rows = []
    for p in reversed(proposals):
        fate = "" if p.pending else f"<br><small>by {html.escape(str(p.decided_by))}" + (
            f": {html.escape(p.decision)}" if p.decision else "") + (
            f" ({html.escape(p.note)})" if p.note else "") + "</small>"
        rows.append(f"<tr><td>{p.id}</td><td>{p.step}</td><td>{html.escape(p.source)}</td>"
                    f"<td>{html.escape(p.change_text)}</td><td style='color:{_COLORS.get(p.state, '#000000')}'>"
                    f"<b>{p.state}</b>{fate}</td><td>{html.escape(p.reason or '')}</td></tr>")
    head = "<tr><th>id</th><th>step</th><th>from</th><th>change</th><th>state</th><th>reason</th></tr>"
    return f"<table class='workbench-proposals'>{head}{''.join(rows)}</table>"


class AutopilotTab:
    """The Autopilot tab: the waiting proposals (Accept, Reject), the run's proposals and an
    in-kernel autopilot's decisions."""

    def __init__(self, panel: Panel, autopilot: Any = None) -> None:
        self.panel = panel
        self.autopilot = autopilot
        self._version = -1
        self._proposals: Any = None  # the run's proposals as last drawn (the snapshot's tuple)
        self.pending = 0  # how many proposals wait for an answer (the tab's title counts them)
        self.head = w.HTML()
        self.proposal = w.Dropdown(options=[], description="proposal", layout=w.Layout(width="520px"))
        self.accept_button = w.Button(description="Accept", icon="check", button_style="primary",
                                      tooltip="Apply the selected proposal to the run (an autopilot's: checked "
                                              "against its limits again)")
        self.reject_button = w.Button(description="Reject", icon="times", tooltip="Drop the selected proposal")
        self.run_table = w.HTML()
        self.table = w.HTML()
        self.box = w.VBox([self.head, w.HBox([self.proposal, self.accept_button, self.reject_button],
                                             layout=w.Layout(flex_flow="row wrap", align_items="center")),
                           self.run_table, self.table])
        self.widgets: list[w.Widget] = [self.head, self.proposal, self.accept_button, self.reject_button,
                                        self.run_table, self.table, *self.box.children, self.box]
        self.accept_button.on_click(panel._guard(self.on_accept))
        self.reject_button.on_click(panel._guard(self.on_reject))
        self.show(())

    @property
    def stale(self) -> bool:
        """Whether the in-kernel autopilot's decisions changed since they were last drawn (the
        run's proposals come with the snapshot, which the panel compares itself)."""
        return self.autopilot is not None and self.autopilot.version != self._version

    def _owned(self) -> set[int]:
        """The run's proposals this kernel's autopilot published (its decisions stand for them)."""
        pilot = self.autopilot
        return {d.published for d in pilot.decisions if d.published is not None} if pilot is not None else set()

    def show(self, proposals: Any) -> None:
        """Draw the proposals and decisions again when they changed (``proposals``: the snapshot's)."""
        if proposals is self._proposals and not self.stale:
            return
        self._proposals = proposals
        pilot = self.autopilot
        owned = self._owned()
        waiting = [p for p in proposals if p.pending and p.id not in owned]
        options = [(f"{p.id} {p.change_text} from {p.source}: {p.reason or ''}"[:120], ("run", p.id)) for p in waiting]
        if pilot is None:
            self.head.value = ("<b>the run's proposals</b> · from any client (an autopilot in dry-run mode, a "
                               "script, workbench ctl); Accept applies one as a live edit")
            self.table.value = ""
        else:
            self._version = pilot.version
            names = ", ".join(getattr(p, "name", type(p).__name__) for p in pilot.policies)
            mode = "dry run: proposals wait for you" if pilot.dry_run else "acting within its limits"
            error = (f"<br><span style='color:#c62828'>last poll failed: {html.escape(pilot.error)}</span>"
                     if pilot.error else "")
            self.head.value = (f"<b>{html.escape(names)}</b> · {mode}<br><small>limits: "
                               f"{html.escape(pilot.limits.describe())}</small>{error}")
            # The autopilot's own proposals by its numbers (as before), the run's others after them.
            options = [(f"#{d.id} {d.change_text}{' (revert)' if d.kind == 'revert' else ''}: {d.reason}"[:120], d.id)
                       for d in pilot.proposals()] + options
            self.table.value = decisions_html(pilot.decisions)
        others = [p for p in proposals if p.id not in owned]
        self.run_table.value = proposals_html(others) if others or pilot is None else ""
        if tuple(self.proposal.options) != tuple(options):
            selected = self.proposal.value
            self.proposal.options = options
            values = [value for _, value in options]
            self.proposal.value = selected if selected in values else (values[0] if values else None)
        self.pending = len(options)
        self.accept_button.disabled = self.reject_button.disabled = not options

    def _selected(self) -> Any:
        if self.proposal.value is None:
            raise ValueError("no proposal selected")
        return self.proposal.value

    def _decide(self, ident: int, accept: bool) -> Proposal:
        """Decide one of the run's proposals, as the notebook (the run records who decided)."""
        with calling_as("notebook"):
            return self.panel.session.decide(ident, accept, reason=None if accept else "rejected in the notebook")

    def on_accept(self) -> None:
        """Accept the selected proposal: the run applies it (an autopilot's: checked against its limits again)."""
        value = self._selected()
        if isinstance(value, tuple):
            proposal = self._decide(value[1], True)
            self.panel._set_notice("good", f"proposal {proposal.id} {proposal.change_text}: {proposal.state}")
            return
        decision = self.autopilot.accept(int(value))
        level = "good" if decision.state in ("sent", "applied") else "error"
        self.panel._set_notice(level, f"autopilot #{decision.id} {decision.change_text}: {decision.state}"
                               + (f" ({decision.note})" if level == "error" and decision.note else ""))

    def on_reject(self) -> None:
        """Drop the selected proposal: nothing is sent."""
        value = self._selected()
        if isinstance(value, tuple):
            proposal = self._decide(value[1], False)
            self.panel._set_notice("info", f"proposal {proposal.id} {proposal.change_text}: rejected")
            return
        decision = self.autopilot.reject(int(value), "rejected in the notebook")
        self.panel._set_notice("info", f"autopilot #{decision.id} {decision.change_text}: rejected")
