"""The panel's steering tabs beyond single numbers (issue 28): Schedule and Fork.

Schedule: pick a change of the schedule's shape (decay now, extend, rewarm, scale the
peak), type its arguments as ``key=value`` words, Preview it (the learning-rate chart draws
the planned rate after the change dashed, next to the current plan, and nothing is applied)
and Apply it with a reason: a live edit the run checks and records. The session reads the
text (the same rule as ``set(schedule=...)``, the dashboard's form and ``workbench ctl``), and
its one-line refusal is the panel's notice.

Fork: type variants (``b: learning_rate=1e-3``, one a line), Fork (the memory it holds is
checked first and reported), and read each variant's train loss drawn from the pause over the
parent's and its evaluation as a dot over the parent's evaluations, with a table of the final
numbers; then Keep one or Discard.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import html

import ipywidgets as w

from workbench.widgets.fork_view import (FORK_HINT, fork_cost_text, fork_eval_series, fork_metrics, fork_rows,
                                         fork_series, fork_summary, parse_variants)

# The tabs are given the Panel that holds them (typed Any: panel.py imports this module).
Panel = Any

__all__ = ["ScheduleTab", "SCHEDULE_HINTS", "ForkTab", "fork_table_html"]

# Each schedule change and the arguments its field takes (core/schedule_edits.py has the rule).
SCHEDULE_HINTS = {
    "decay_now": "steps=200 [to=0 | to=min_lr] [shape=linear | cosine]",
    "extend": "max_steps=2000",
    "rewarm": "steps=50 peak=3e-4 [shape=cosine]",
    "scale_peak": "factor=0.5",
}


def _button(description: str, icon: str, tooltip: str, style: str = "") -> w.Button:
    return w.Button(description=description, icon=icon, tooltip=tooltip, button_style=style,
                    layout=w.Layout(width="auto", min_width="92px"))


class ScheduleTab:
    """The Schedule tab: a change, its preview on the learning-rate chart, and Apply."""

    def __init__(self, panel: Panel) -> None:
        self.panel = panel
        self.preview: tuple[tuple[int, float], ...] = ()  # the planned rate after the change (dashed)
        self.op = w.Dropdown(options=list(SCHEDULE_HINTS), value="decay_now", description="change",
                             layout=w.Layout(width="220px"))
        self.args = w.Text(placeholder=SCHEDULE_HINTS["decay_now"], layout=w.Layout(width="330px"))
        self.reason = w.Text(placeholder="why (kept with the edit)", layout=w.Layout(width="330px"))
        self.preview_button = _button("Preview", "eye", "Draw the learning rate this change would give (dashed, "
                                      "orange) without applying it")
        self.apply_button = _button("Apply", "check", "Make the change: a live edit recorded with its reason",
                                    "primary")
        self.help = w.HTML("<small>The learning-rate chart draws the plan for the rest of the run dashed: "
                           "green as it is, orange as the previewed change would make it.</small>")
        self.box = w.VBox([w.HBox([self.op, self.args], layout=w.Layout(flex_flow="row wrap", align_items="center")),
                           w.HBox([self.reason, self.preview_button, self.apply_button],
                                  layout=w.Layout(flex_flow="row wrap", align_items="center")),
                           self.help])
        self.widgets: list[w.Widget] = [self.op, self.args, self.reason, self.preview_button, self.apply_button,
                                        self.help, *self.box.children, self.box]
        self.op.observe(self._on_op, "value")
        self.preview_button.on_click(panel._guard(self.on_preview))
        self.apply_button.on_click(panel._guard(self.on_apply))

    def text(self) -> str:
        """The change as typed: its operation and its ``key=value`` words."""
        return f"{self.op.value} {self.args.value}".strip()

    def _on_op(self, change: dict[str, Any]) -> None:
        self.args.placeholder = SCHEDULE_HINTS.get(change["new"], "")
        self.preview = ()
        self.panel._last = None  # redraw: the old preview goes

    def on_preview(self) -> None:
        """Draw the planned rate after the change (the session checks it; nothing applied)."""
        self.preview = tuple(self.panel.session.lr_plan(self.text()))
        if self.preview:
            self.panel._set_notice("info", f"preview of {self.text()}: dashed orange on the learning-rate chart "
                                   f"(ends at step {self.preview[-1][0]}); Apply to make it")
        else:
            self.panel._set_notice("warn", f"{self.text()}: no steps left to plan")

    def on_apply(self) -> None:
        """Apply the change as a live edit with the reason typed."""
        text = self.text()
        result = self.panel.session.set(schedule=text, reason=self.reason.value.strip() or None)
        self.preview = ()
        if isinstance(result, Future):
            self.panel._set_notice("info", f"{text}: applied at the next step end")
            self.panel._follow(result, lambda applied: f"schedule changed: {text}", "schedule")
        else:
            self.panel._set_notice("good", f"schedule changed: {text}")
        self.args.value = ""
        self.reason.value = ""


# -- the Fork tab -------------------------------------------------------------------------------------

FORK_COLORS = ("#d62728", "#17becf", "#bcbd22", "#e377c2", "#8c564b", "#7f7f7f", "#1f77b4", "#ff7f0e")
def fork_table_html(report: dict[str, Any] | None) -> str:
    """The fork's final numbers, one row a variant (and the parent at the pause)."""
    if not report or not report.get("variants"):
        return "<i>No fork yet: pause the run, type the variants, press Fork.</i>"
    head = "".join(f"<th>{html.escape(m)}</th>" for m in fork_metrics(report))
    rows = []
    for row in fork_rows(report):
        name = f"<i>{html.escape(row['name'])}</i>" if row["parent"] else f"<b>{html.escape(row['name'])}</b>"
        cells = [name + (" ★" if row["kept"] else ""), html.escape(row["changes"]), row["loss"], *row["metrics"],
                 row["same"]]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<b>{html.escape(fork_summary(report))}</b>"
            f"<table><tr><th>variant</th><th>changes</th><th>train loss</th>{head}<th>same batches</th></tr>"
            + "".join(rows) + "</table>")


class ForkTab:
    """The Fork tab: variants as typed, Fork, the variants' loss over the parent's, Keep or Discard."""

    def __init__(self, panel: Panel) -> None:
        from .charts import LiveChart, Trace

        self.panel = panel
        self.variants = w.Textarea(placeholder=FORK_HINT, layout=w.Layout(width="420px", height="90px"))
        self.steps = w.BoundedIntText(value=50, min=1, max=100_000, description="steps",
                                      layout=w.Layout(width="160px"))
        self.fork_button = _button("Fork", "code-fork", "Train each variant from the paused run on the same batches, "
                                   "then evaluate it (the run goes back to the pause)", "primary")
        self.keep_select = w.Dropdown(options=[], description="keep", layout=w.Layout(width="200px"))
        self.keep_button = _button("Keep", "check", "Continue the run from the selected variant's state")
        self.discard_button = _button("Discard", "times", "Continue from the pause point unchanged")
        self.save_button = _button("Save", "save", "Save the selected variant as a checkpoint in a folder of its own "
                                   "(the fork stays open)")
        self.save_folder = w.Text(placeholder="folder (default: OUTPUT_DIR-forkN-NAME)", layout=w.Layout(width="300px"))
        # What the fork would hold, said before it starts (the kernel then waits while it trains).
        self.memory = w.HTML("<small>memory: checked and shown here when you press Fork</small>")
        self.table = w.HTML(fork_table_html(None))
        traces = [Trace("parent", "parent", "#1f77b4"), Trace("parent_eval", "parent eval", "#ff7f0e", marker="circle")]
        traces += [Trace(f"variant{i}", f"variant {i + 1}", color) for i, color in enumerate(FORK_COLORS[:6])]
        # Each variant's evaluation: a dot in its curve's colour (out of the legend: its curve names it).
        traces += [Trace(f"variant{i}_eval", f"variant {i + 1} eval", color, marker="circle")
                   for i, color in enumerate(FORK_COLORS[:6])]
        self.chart = LiveChart("Fork: train loss from the pause, evaluations as dots", traces, left_label="loss",
                               width="98%", height="260px")
        for i in range(6):
            self.chart.lines[f"variant{i}_eval"].display_legend = False
        self._drawn: Any = None
        self.box = w.VBox([w.HBox([self.variants, w.VBox([self.steps, self.fork_button])],
                                  layout=w.Layout(flex_flow="row wrap", align_items="flex-start")),
                           self.memory,
                           w.HBox([self.keep_select, self.keep_button, self.save_button, self.save_folder,
                                   self.discard_button],
                                  layout=w.Layout(flex_flow="row wrap", align_items="center")),
                           self.table, self.chart.figure])
        self.widgets: list[w.Widget] = [self.variants, self.steps, self.fork_button, self.memory, self.keep_select,
                                        self.keep_button, self.save_button, self.save_folder, self.discard_button,
                                        self.table, *self.box.children,
                                        self.box]
        self.fork_button.on_click(panel._guard(self.on_fork))
        self.keep_button.on_click(panel._guard(self.on_keep))
        self.discard_button.on_click(panel._guard(self.on_discard))
        self.save_button.on_click(panel._guard(self.on_save))

    def on_fork(self) -> None:
        """Check the memory and show the figure, then fork (the kernel waits while the variants
        train); a fork that would not fit is refused here with the figure, nothing trained."""
        session, variants, steps = self.panel.session, parse_variants(self.variants.value), int(self.steps.value)
        cost = session.fork_cost(variants, steps)
        # Set directly, not through a notice: the panel's refresh waits for this handler, and
        # the figure belongs on screen while the variants train.
        self.memory.value = html.escape(f"memory: {fork_cost_text(cost)}") + (
            "" if cost["fits"] else " <b>(would not fit)</b>")
        if not cost["fits"]:
            raise RuntimeError(f"fork: refused, it would not fit: {fork_cost_text(cost)}")
        self.memory.value = f"<b>forking {len(variants)} variants x {steps} steps</b>: " + self.memory.value
        report = session.fork(variants, steps)
        self.panel._set_notice("good", f"fork {report['id']}: {len(report['variants'])} variants trained {steps} "
                               f"steps ({cost['bytes'] / 2**20:.1f} MiB held); keep one or discard")
        self.show(report)

    def on_keep(self) -> None:
        name = self.keep_select.value
        if not name:
            raise ValueError("keep: fork first, then pick a variant")
        kept = self.panel.session.keep(name)
        self.panel._set_notice("good", f"kept {name}: {kept.get('reason', '')}")

    def on_save(self) -> None:
        name = self.keep_select.value
        if not name:
            raise ValueError("save: fork first, then pick a variant")
        path = self.panel.session.save_variant(name, self.save_folder.value.strip() or None)
        self.panel._set_notice("good", f"variant {name} saved to {path} (resume it with --resume {path}); "
                               "keep one or discard")

    def on_discard(self) -> None:
        self.panel.session.discard()
        self.panel._set_notice("info", "fork discarded: the run goes on from the pause unchanged")

    def show(self, report: dict[str, Any] | None) -> None:
        """Draw a fork's report (the table, the curves over the parent's loss); cheap when unchanged."""
        key = (report or {}).get("id"), (report or {}).get("state"), len((report or {}).get("saved") or ())
        if key == self._drawn or report is None:
            return
        self._drawn = key
        self.table.value = fork_table_html(report)
        if report.get("memory"):  # (a fork made by a script or a remote client shows its figure too)
            self.memory.value = html.escape(f"memory: {fork_cost_text(report['memory'])}")
        names = list(report.get("variants", {}))
        self.keep_select.options = names if report.get("state") == "done" else []
        snapshot_series = self.panel.session.snapshot().series
        curves = fork_series(report, list(snapshot_series.get("loss", ())))
        evals = fork_eval_series(report, snapshot_series)
        series: dict[str, Any] = {"parent": curves["parent"], "parent_eval": evals.get("parent", [])}
        for i, name in enumerate(names[:6]):
            series[f"variant{i}"] = curves[name]
            series[f"variant{i}_eval"] = evals.get(name, [])
            self.chart.lines[f"variant{i}"].labels = [name]
            self.chart.lines[f"variant{i}_eval"].labels = [f"{name} eval"]
        self.chart.update(series, report["step"] + report["steps"])
        start = min([report["step"]] + [points[0][0] for points in (series["parent"], series["parent_eval"]) if points])
        self.chart.x_scale.min = float(start)
