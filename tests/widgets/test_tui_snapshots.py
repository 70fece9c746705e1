"""The dashboard's pictures and pure pieces. Snapshot tests (pytest-textual-snapshot) render
the main, checkpoints and inspect screens from fixed data, so the pictures do not depend on
timing or on the machine's floating point; the pure pieces (formatting, downsampling,
smoothing, rows) are checked as plain functions.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from workbench import TrainingArguments
from workbench.checkpoint.store import CheckpointStore
from workbench.config.loader import parse_overrides
from workbench.core.edits import validate_edits
from workbench.door.values import CheckpointRow, Intervention, MemoryUsage, SessionEvent, Snapshot
from workbench.widgets.tui import DashboardApp
from workbench.widgets.tui.checkpoints import CheckpointsScreen
from workbench.widgets.tui.inspect import InspectScreen
from workbench.widgets.view import (
    describe_event,
    downsample,
    fmt_bytes,
    fmt_duration,
    fmt_number,
    memory_rows,
    metric_rows,
    smooth,
)

from support.dashboard import log_text, wait_for

# ----------------------------------------------------------------------------- snapshot tests


NOW = 1_700_000_000.0


def _series() -> dict[str, tuple]:
    loss = tuple((s, 4.2 * math.exp(-s / 90) + 1.3 + 0.08 * math.sin(s / 3)) for s in range(2, 302, 2))
    lr = tuple((s, 3e-3 * min(1.0, s / 30) * (1 - s / 400)) for s in range(2, 302, 2))
    grad = tuple((s, 1.2 + 0.6 * math.exp(-s / 60) + 0.1 * math.cos(s / 5)) for s in range(2, 302, 2))
    evals = ((0, 4.61), (100, 2.35), (200, 1.92), (300, 1.81))
    acc = ((0, 0.04), (100, 0.31), (200, 0.42), (300, 0.44))
    return {"loss": loss, "learning_rate": lr, "grad_norm": grad, "eval_loss": evals, "eval_accuracy": acc}


def _write_checkpoint(root: Path, step: int, eval_loss: float, best: str, args: dict, edits: list) -> None:
    """A checkpoint folder with the small files the catalog reads (fixed bytes, fixed times)."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    state = {"global_step": step, "epoch": step / 75, "best_model_checkpoint": str(root / best),
             "log_history": [{"eval_loss": eval_loss, "eval_runtime": 0.5, "step": step}], "live_edits": edits}
    (path / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    (path / "training_args.json").write_text(json.dumps(args), encoding="utf-8")
    files = {"model.safetensors": {"size": 271_000 + step, "sha256": "0"},
             "optimizer.pt": {"size": 545_000, "sha256": "0"}}
    manifest = {"format": 1, "step": step, "created": NOW - 3600 + step * 6, "files": files}
    (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


class FixedSession:
    """A finished or paused run frozen in time: the Session's read API over fixed data.

    Only the snapshot tests use it: they need pixels that do not depend on timing or on the
    machine's floating point. The behaviour of the real Session is covered by the Pilot
    tests above.
    """

    successor = None

    def __init__(self, root: Path, status: str, interventions: tuple = ()) -> None:
        self.status = status
        self.stop_reason = None
        self.args = TrainingArguments(str(root), learning_rate=1e-3, max_steps=300, eval_strategy="steps",
                                      eval_steps=100, save_steps=100, metric_for_best_model="eval_loss",
                                      run_name="tiny-gpt", report_to="none")
        saved = json.loads(self.args.to_json_string())
        saved_old = dict(saved, learning_rate=3e-3)
        _write_checkpoint(root, 100, 2.35, "checkpoint-200", saved_old, [])
        _write_checkpoint(root, 200, 1.92, "checkpoint-200", saved_old, [])
        _write_checkpoint(root, 300, 1.81, "checkpoint-200", saved,
                          [{"step": 250, "time": NOW, "learning_rate": 1e-3}])
        self.memory_report = MemoryUsage(parameters=271_104, gradients=271_104, optimizer_state=542_720,
                                          device_type="cpu", device_allocated=None, device_reserved=None,
                                          device_peak=None, host_rss=612_000_000, host_peak=650_000_000)
        step = 300 if status == "finished" else 250
        series = {k: tuple(p for p in v if p[0] <= step) for k, v in _series().items()}
        self._snapshot = Snapshot(
            status=status, step=step, max_steps=300, epoch=step / 75, elapsed=95.0, steps_per_second=3.2,
            samples_per_second=51.2, tokens_per_second=6553.6, eta=None if status == "finished" else 15.6,
            series=series, best_metric=1.92, best_step=200, memory=self.memory_report,
            checkpoints=tuple(CheckpointRow.from_dict(c.to_dict()) for c in CheckpointStore(root).list()
                              if c.step <= step),
            edits=({"step": 250, "time": NOW, "learning_rate": 1e-3},), run_name="tiny-gpt",
            interventions=interventions, guard_interventions=len(interventions),
            output_dir="runs/tiny-gpt", device="cpu", updated=NOW)
        self.events: list[SessionEvent] = []
        for kind, at, data in [("started", 0, {"max_steps": 300}), ("evaluated", 0, {"eval_loss": 4.61}),
                               ("evaluated", 100, {"eval_loss": 2.35, "eval_accuracy": 0.31}),
                               ("saved", 100, {"checkpoint": str(root / "checkpoint-100")}),
                               ("evaluated", 200, {"eval_loss": 1.92, "eval_accuracy": 0.42}),
                               ("saved", 200, {"checkpoint": str(root / "checkpoint-200")}),
                               ("paused", 250, {}), ("edited", 250, {"learning_rate": 1e-3})]:
            self.events.append(SessionEvent(kind, at, NOW, data))

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        return self.events[cursor:], len(self.events)

    def arguments(self) -> dict[str, Any]:
        return json.loads(self.args.to_json_string())

    @property
    def checkpoints(self) -> list:
        return list(self._snapshot.checkpoints)

    def inspect(self) -> dict[str, Any]:
        layers = []
        for i, (name, shape) in enumerate([("wte.weight", (99, 32)), ("wpe.weight", (32, 32)),
                                           ("blocks.0.attn.qkv.weight", (96, 32)), ("blocks.0.mlp.fc.weight", (128, 32)),
                                           ("ln_f.weight", (32,)), ("head.weight", (99, 32))]):
            layers.append({"name": name, "shape": shape, "param_norm": 1.5 + i * 0.75, "grad_norm": 0.05 * (i + 1),
                           "update_ratio": 1e-3 * (i + 1), "nan": 0, "inf": 0, "trainable": True})
        return {"step": 250, "layers": layers, "learning_rates": [1e-3],
                "batch_shapes": {"input_ids": (8, 32), "labels": (8, 32)},
                "can_sample": False}  # no prompt box in the picture

    def memory(self) -> MemoryUsage:
        return self.memory_report


def fixed_app(tmp_path: Path, status: str, interventions: tuple = ()) -> DashboardApp:
    return DashboardApp(FixedSession(tmp_path / "runs" / "tiny-gpt", status, interventions), autostart=False,
                        frozen=True)


GUARDED = (
    Intervention(step=64, kind="nonfinite", action="skip", value="nan", threshold=2.41, samples=(17, 902, 311, 45)),
    Intervention(step=150, kind="spike", action="rollback", value=412.5, threshold=5.2, samples=(7, 88, 630, 1021),
                 restored_step=100, skipped_samples=208),
    Intervention(step=230, kind="spike", action="skip", value=61.0, threshold=4.4,
                 samples=(3, 14, 159, 265, 358, 979, 323, 846)),
)


async def _events_shown(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.dashboard.query("#events"), "the dashboard")
    await wait_for(pilot, lambda: len(log_text(app).splitlines()) >= 8, "the fixed events")
    await wait_for(pilot, lambda: app.dashboard.query_one("#loss-chart").plotted.get("eval_loss"), "the charts")
    # The layout after the status switch (summary or progress line) is redone after a
    # refresh: on a loaded machine a fixed pause could take the picture before it.
    from workbench.widgets.tui.panels import ProgressPanel, SummaryPanel

    panel = SummaryPanel if app.session.status in ("finished", "stopped", "failed") else ProgressPanel
    await wait_for(pilot, lambda: app.dashboard.query_one(panel).region.height > 0, "the layout for the status")
    await pilot.pause(0.1)


def test_an_ended_runs_snapshot_is_shown_again_until_every_panel_took_it(tmp_path, monkeypatch):
    """An ended run's snapshot never changes: a first show that meets a panel not composed
    yet (NoMatches, seen on a loaded machine) is retried, not left half shown."""
    from textual.css.query import NoMatches

    from workbench.widgets.tui.dashboard import DashboardScreen
    from workbench.widgets.tui.panels import SummaryPanel

    real, failed = DashboardScreen._show, []

    def first_show_meets_an_uncomposed_panel(self, snapshot, frozen):
        if not failed:
            failed.append(True)
            raise NoMatches("SummaryPanel")
        return real(self, snapshot, frozen)

    monkeypatch.setattr(DashboardScreen, "_show", first_show_meets_an_uncomposed_panel)
    app = fixed_app(tmp_path, "finished")

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            summary = app.dashboard.query_one(SummaryPanel)
            await wait_for(pilot, lambda: "finished at step 300/300" in str(summary.render()), "the summary")

    asyncio.run(main())
    assert failed


def test_snapshot_main_screen_finished_80x24(tmp_path, snap_compare):
    assert snap_compare(fixed_app(tmp_path, "finished"), terminal_size=(80, 24), run_before=_events_shown)


def test_snapshot_main_screen_paused_large(tmp_path, snap_compare):
    assert snap_compare(fixed_app(tmp_path, "paused"), terminal_size=(130, 40), run_before=_events_shown)


def test_snapshot_main_screen_with_guard_interventions(tmp_path, snap_compare):
    async def guard_shown(pilot):
        await _events_shown(pilot)
        await wait_for(pilot, lambda: pilot.app.dashboard.query_one("#loss-chart").plotted.get("interventions"),
                       "the guard marks")
        await pilot.pause(0.1)

    assert snap_compare(fixed_app(tmp_path, "finished", GUARDED), terminal_size=(110, 32), run_before=guard_shown)


def test_snapshot_checkpoints_screen(tmp_path, snap_compare):
    async def open_checkpoints(pilot):
        await _events_shown(pilot)
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, CheckpointsScreen), "the checkpoints screen")
        await pilot.press("up")  # checkpoint-200: the best, with a config difference
        await pilot.pause(0.1)

    assert snap_compare(fixed_app(tmp_path, "finished"), terminal_size=(110, 30), run_before=open_checkpoints)


def test_snapshot_inspect_screen(tmp_path, snap_compare):
    async def open_inspect(pilot):
        await _events_shown(pilot)
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, InspectScreen) and pilot.app.screen.report,
                       "the inspection")
        await pilot.pause(0.1)

    assert snap_compare(fixed_app(tmp_path, "paused"), terminal_size=(110, 30), run_before=open_inspect)


# ----------------------------------------------------------------------------- pure pieces


def test_downsample_keeps_spikes_and_the_ends():
    points = [(s, 1.0) for s in range(10_000)]
    points[5_003] = (5_003, 50.0)
    out = downsample(points, 100)
    assert len(out) <= 104
    assert (5_003, 50.0) in out
    assert out[0] == points[0] and out[-1] == points[-1]
    assert [p[0] for p in out] == sorted(p[0] for p in out)
    assert downsample(points[:10], 100) == points[:10]


def test_smooth_is_debiased_and_keeps_non_finite_values_visible():
    points = [(1, 2.0), (2, 2.0), (3, float("nan")), (4, 2.0)]
    out = smooth(points, weight=0.9)
    assert out[0] == (1, pytest.approx(2.0)) and out[1][1] == pytest.approx(2.0)
    assert math.isnan(out[2][1])


def test_formatting():
    assert fmt_number(None) == "-" and fmt_number(float("nan")) == "nan" and fmt_number(2.345678) == "2.346"
    assert fmt_duration(5) == "5s" and fmt_duration(184) == "3m 04s" and fmt_duration(3720) == "1h 02m"
    assert fmt_duration(None) == "-"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.5 KB" and fmt_bytes(3 * 1024**3) == "3.0 GB"


def test_metric_rows_mark_the_metric_that_picks_the_best_checkpoint():
    series = _series()
    rows = {r.name: r for r in metric_rows(series, best_metric=1.92, best_step=200)}
    assert list(rows)[0] == "eval_loss"
    assert rows["eval_loss"].selects_best and rows["eval_loss"].best == 1.92 and rows["eval_loss"].best_step == 200
    assert rows["eval_loss"].latest == 1.81
    assert not rows["eval_accuracy"].selects_best and rows["eval_accuracy"].best == 0.44  # higher is better
    assert "loss" in rows and "learning_rate" not in rows


def test_memory_rows_and_events_read_plainly():
    report = MemoryUsage(100, 100, 200, "cuda", 1000, 2000, 1500, 10, 20)
    rows = {r.label: r for r in memory_rows(report)}
    assert rows["params"].scale == 400 and rows["activ."].value == 1100 and rows["cuda"].peak == 1500
    assert describe_event("logged", 3, {"loss": 1.0}) is None
    assert describe_event("logged", 3, {"loss": float("nan")})[0] == "warn"
    assert describe_event("saved", 7, {"checkpoint": "/x/checkpoint-7"}) == ("good", "step 7: saved checkpoint-7")


def test_the_forms_text_is_read_by_the_session_layer():
    # What the edit and branch forms send (text as typed) and how the session layer reads it.
    assert validate_edits({"learning_rate": "1e-4", "eval_steps": "50"}, 10) == {"learning_rate": 1e-4, "eval_steps": 50}
    for texts, message in [({"learning_rate": "x"}, "not a number"), ({"max_steps": "2.5"}, "whole number"),
                           ({"max_steps": "5"}, "below the current step"), ({}, "nothing to change"),
                           ({"learning_rate": "1e-3", "lr_scale": "2"}, "not both"),
                           ({"lr_scale": "0"}, "positive")]:
        with pytest.raises(ValueError, match=message):
            validate_edits(texts, 10)
    assert parse_overrides("warmup_steps=10, training.lr_scheduler_type=linear") == {
        "warmup_steps": 10, "lr_scheduler_type": "linear"}
    assert parse_overrides({"learning_rate": "1e-3", "max_steps": ""}) == {"learning_rate": 1e-3}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides("oops")
