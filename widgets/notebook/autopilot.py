"""The panel's Autopilot tab (``Panel(session, autopilot=...)``, issue 28).

An Autopilot (workbench.autopilot) steering the run from this kernel keeps its decisions
and, in dry-run mode, its proposals. This tab lists them (newest first) with the autopilot's
policies and limits, and lets a person pick a waiting proposal and Accept it (the autopilot
checks it against its limits again and sends it with its reason) or Reject it (nothing is
sent). The tab decides nothing itself: it calls ``accept`` and ``reject``.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

__all__ = ["AutopilotTab", "decisions_html"]

# Panel is typed Any here: panel.py imports this module.
Panel = Any

_COLORS = {"proposed": "#b58900", "applied": "#2e7d32", "refused": "#c62828", "failed": "#c62828",
           "held": "#777777", "rejected": "#777777", "superseded": "#777777", "sent": "#1565c0"}


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


class AutopilotTab:
    """The Autopilot tab: the waiting proposals (Accept, Reject) and every decision."""

    def __init__(self, panel: Panel, autopilot: Any) -> None:
        self.panel = panel
        self.autopilot = autopilot
        self._version = -1
        self.head = w.HTML()
        self.proposal = w.Dropdown(options=[], description="proposal", layout=w.Layout(width="520px"))
        self.accept_button = w.Button(description="Accept", icon="check", button_style="primary",
                                      tooltip="Send the selected proposal to the run (checked against the limits again)")
        self.reject_button = w.Button(description="Reject", icon="times", tooltip="Drop the selected proposal")
        self.table = w.HTML()
        self.box = w.VBox([self.head, w.HBox([self.proposal, self.accept_button, self.reject_button],
                                             layout=w.Layout(flex_flow="row wrap", align_items="center")),
                           self.table])
        self.widgets: list[w.Widget] = [self.head, self.proposal, self.accept_button, self.reject_button, self.table,
                                        *self.box.children, self.box]
        self.accept_button.on_click(panel._guard(self.on_accept))
        self.reject_button.on_click(panel._guard(self.on_reject))
        self.show()

    @property
    def stale(self) -> bool:
        """Whether the autopilot's decisions changed since they were last drawn."""
        return self.autopilot.version != self._version

    @property
    def pending(self) -> int:
        """How many proposals wait for an answer."""
        return len(self.autopilot.proposals())

    def show(self) -> None:
        """Draw the proposals and decisions again when they changed."""
        if not self.stale:
            return
        pilot = self.autopilot
        self._version = pilot.version
        names = ", ".join(getattr(p, "name", type(p).__name__) for p in pilot.policies)
        mode = "dry run: proposals wait for you" if pilot.dry_run else "acting within its limits"
        error = f"<br><span style='color:#c62828'>last poll failed: {html.escape(pilot.error)}</span>" if pilot.error else ""
        self.head.value = (f"<b>{html.escape(names)}</b> · {mode}<br><small>limits: "
                           f"{html.escape(pilot.limits.describe())}</small>{error}")
        proposals = pilot.proposals()
        options = [(f"#{d.id} {d.change_text}{' (revert)' if d.kind == 'revert' else ''}: {d.reason}"[:120], d.id)
                   for d in proposals]
        if tuple(self.proposal.options) != tuple(options):
            selected = self.proposal.value
            self.proposal.options = options
            ids = [d.id for d in proposals]
            self.proposal.value = selected if selected in ids else (ids[0] if ids else None)
        self.accept_button.disabled = self.reject_button.disabled = not proposals
        self.table.value = decisions_html(pilot.decisions)

    def _selected(self) -> int:
        if self.proposal.value is None:
            raise ValueError("no proposal selected")
        return int(self.proposal.value)

    def on_accept(self) -> None:
        """Send the selected proposal (the autopilot checks it against its limits again)."""
        decision = self.autopilot.accept(self._selected())
        level = "good" if decision.state in ("sent", "applied") else "error"
        self.panel._set_notice(level, f"autopilot #{decision.id} {decision.change_text}: {decision.state}"
                               + (f" ({decision.note})" if level == "error" and decision.note else ""))

    def on_reject(self) -> None:
        """Drop the selected proposal: nothing is sent."""
        decision = self.autopilot.reject(self._selected(), "rejected in the notebook")
        self.panel._set_notice("info", f"autopilot #{decision.id} {decision.change_text}: rejected")
