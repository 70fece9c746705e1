"""What both front-ends show of an A/B fork (issue 28), in the same words: the variants as a
user types them, a fork report's rows and curves, and its one-line summary.

Pure functions of the text typed and of ``Snapshot.fork`` (session/fork_commands.py's report),
free of any UI library, so the dashboard and the panel cannot drift apart and the wording is
tested without a terminal or a browser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workbench.widgets.view import Point, fmt_number

__all__ = ["FORK_HINT", "parse_variants", "change_text", "fork_metrics", "fork_rows", "fork_series",
           "fork_eval_metric", "fork_eval_series", "fork_cost_text", "fork_summary", "fork_state"]

FORK_HINT = ("one variant a line, NAME: KEY=VALUE, ... (nothing after the colon: the run unchanged), e.g.\n"
             "a:\nb: learning_rate=1e-3\nc: schedule=decay_now steps=50 shape=cosine")


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    """The variants as typed, one a line (``b: learning_rate=1e-3, eval_steps=10``); the
    values stay text: the session reads and checks them (the one rule of each edit)."""
    variants: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, rest = line.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"fork: expected NAME: KEY=VALUE, ... on each line, got {line.strip()!r}")
        changes: dict[str, str] = {}
        for pair in filter(str.strip, rest.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip() or not value.strip():
                raise ValueError(f"fork: variant {name.strip()}: expected KEY=VALUE, got {pair.strip()!r}")
            changes[key.strip()] = value.strip()
        variants[name.strip()] = changes
    if not variants:
        raise ValueError("fork: type at least one variant, e.g. b: learning_rate=1e-3")
    return variants


def change_text(changes: dict[str, Any]) -> str:
    """A variant's changes as one phrase (a schedule change by its operation and arguments)."""
    def shown(value: Any) -> str:
        if isinstance(value, dict) and "op" in value:
            return " ".join(str(value[k]) if k == "op" else f"{k}={value[k]}" for k in value
                            if k in ("op", "steps", "to", "shape", "max_steps", "peak", "factor"))
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return ", ".join(f"{k}={shown(v)}" for k, v in changes.items()) or "(unchanged)"


def fork_metrics(report: dict[str, Any]) -> list[str]:
    """The evaluation metrics any variant reported, in a stable order."""
    return sorted({k for v in report.get("variants", {}).values() for k in v["eval"]})


def fork_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row a variant, the parent at the pause first: name, changes, final train loss,
    each metric (text; "" where absent), whether its batches equal the first variant's, kept."""
    metrics = fork_metrics(report)
    parent = report.get("parent", {}).get("eval", {})
    rows = [{"name": f"parent at step {report['step']}", "changes": "", "loss": "", "parent": True, "kept": False,
             "same": "", "metrics": [fmt_number(parent[m]) if m in parent else "" for m in metrics]}]
    variants = report.get("variants", {})
    first = next(iter(variants.values()))["batches"] if variants else None
    for name, v in variants.items():
        rows.append({"name": name, "changes": change_text(v["changes"]), "parent": False,
                     "loss": fmt_number(v["final_loss"]) if v.get("final_loss") is not None else "",
                     "metrics": [fmt_number(v["eval"][m]) if m in v["eval"] else "" for m in metrics],
                     "same": "yes" if v["batches"] == first else "no", "kept": report.get("kept") == name})
    return rows


def fork_series(report: dict[str, Any], parent_loss: list[Point], history: int = 50) -> dict[str, list[Point]]:
    """Curves on one step axis: the parent's last ``history`` logged losses up to the pause,
    then each variant's train loss from the pause (starting at the parent's last point)."""
    step = report["step"]
    parent = [p for p in parent_loss if p[0] <= step][-history:]
    series: dict[str, list[Point]] = {"parent": parent}
    for name, v in report.get("variants", {}).items():
        points = [(int(s), float(x)) for s, x in v["loss"]]
        start = [(step, parent[-1][1])] if parent else []
        series[name] = start + points if points else []
    return series


def fork_eval_metric(report: dict[str, Any]) -> str | None:
    """The evaluation loss the chart draws: ``eval_loss``, else the first ``*_loss`` metric (a
    named eval set's); None without one. Only a loss: it shares the train loss's y axis."""
    metrics = fork_metrics(report) + sorted(report.get("parent", {}).get("eval", {}))
    if "eval_loss" in metrics:
        return "eval_loss"
    return next((m for m in metrics if m.endswith("_loss")), None)


def fork_eval_series(report: dict[str, Any], parent_evals: Mapping[str, Sequence[Point]],
                     history: int = 50) -> dict[str, list[Point]]:
    """The evaluations on the train loss's step axis: "parent" is the run's evaluation curve up
    to the pause (``parent_evals[metric]``, the snapshot's series, from where fork_series
    starts the parent's train loss) ending in the fork's own evaluation of the paused state;
    each variant's is its evaluation after its steps (one point). Empty when the fork
    evaluated no loss."""
    metric = fork_eval_metric(report)
    if metric is None:
        return {}
    step = report["step"]
    # From where fork_series starts the parent's train loss (one window for both), or from the
    # start when that window holds the whole run (an evaluation on start, at step 0, included).
    losses = [s for s, _ in parent_evals.get("loss", ()) if s <= step]
    start = losses[-history] if len(losses) > history else 0
    parent = [(int(s), float(x)) for s, x in parent_evals.get(metric, ()) if start <= s < step]
    at_pause = report.get("parent", {}).get("eval", {}).get(metric)
    if at_pause is not None:  # (an evaluation logged at the pause step measured the same weights)
        parent.append((step, float(at_pause)))
    series: dict[str, list[Point]] = {"parent": parent}
    for name, v in report.get("variants", {}).items():
        value = v["eval"].get(metric)
        series[name] = [(int(v["end_step"]), float(value))] if value is not None else []
    return series


def fork_cost_text(cost: dict[str, Any]) -> str:
    """What a fork would hold, from ``fork_cost`` before it starts: the total, the copies it
    is made of, and the limit it is checked against (the figure a refusal gives too)."""
    mib = 2**20
    ranks = f", on each of {cost['ranks']} ranks of this machine" if cost.get("ranks", 1) > 1 else ""
    text = (f"{cost['bytes'] / mib:.1f} MiB of host memory for {cost['variants']} variants "
            f"({cost['variants'] + 1} copies of weights and optimizer state, {cost['bytes_each'] / mib:.1f} MiB "
            f"each{ranks})")
    if cost.get("limit") is not None:
        text += f"; the limit is {cost['limit'] / mib:.1f} MiB"
    return text


def fork_state(report: dict[str, Any]) -> str:
    """What the fork waits for, or how it ended."""
    state = report.get("state")
    return {"done": "keep one or discard", "kept": f"kept {report.get('kept')}", "discarded": "discarded",
            "training": "training the variants", "failed": "failed: the run is back at the pause"}.get(state, str(state))


def fork_summary(report: dict[str, Any]) -> str:
    """One line: which fork, how many steps from where, the memory it holds, its state, and
    where the variants saved on purpose went."""
    saved = "".join(f"; {name} saved to {path}" for name, path in (report.get("saved") or {}).items())
    return (f"fork {report['id']}: {report['steps']} steps from step {report['step']}, "
            f"{report['memory']['bytes'] / 2**20:.1f} MiB held ({fork_state(report)}){saved}")
