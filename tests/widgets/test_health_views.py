"""Run health in the front-ends: the dashboard's progress line and the notebook panel's status
line say where the time goes ("goodput 93%: data 4%, ..."), MFU where it is known, a hang
first and in red, stragglers; the event log names a hang's rank, phase and step."""

from __future__ import annotations

from types import SimpleNamespace

from workbench.widgets.notebook.tables import status_html
from workbench.widgets.view import describe_event, health_line

from support.dashboard import drive, tiny_session, wait_for

LEDGER = {"startup": 1.0, "compute": 90.0, "data": 5.0, "evaluation": 3.0, "save": 1.0, "paused": 0.0,
          "rolled_back": 0.0, "collective": 0.0, "other": 0.0, "wall": 100.0}
HANG = {"rank": 1, "phase": "data", "stalled_step": 12, "seconds": 125.0, "silent": False, "folder": "out/hang-x"}


def test_the_health_line_puts_a_hang_first_then_goodput_mfu_and_stragglers():
    snapshot = SimpleNamespace(health={"ledger": LEDGER, "throughput": {"mfu": 0.412},
                                       "stragglers": {"ranks": [{"rank": 3, "factor": 2.4}]}})
    assert health_line(snapshot) == "goodput 90%: data 5%, eval 3%, startup 1% · MFU 41% · straggler: rank 3 2.4x"
    snapshot.health["hang"] = HANG
    assert health_line(snapshot).startswith("HANG: rank 1 in data at step 12 for 2m 05s; stacks in out/hang-x")
    assert health_line(SimpleNamespace(health=None)) == ""
    level, text = describe_event("hang", 12, HANG)
    assert level == "error" and "rank 1 stuck in data at step 12" in text


def test_the_dashboard_shows_where_the_time_goes(tmp_path):
    session, _ = tiny_session(tmp_path / "run")

    def progress(app) -> str:
        return str(app.dashboard.query_one("#progress-line").content)

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: session.snapshot().step >= 6, "a few steps")
        await wait_for(pilot, lambda: "goodput" in progress(app) and "step 0/" not in progress(app),
                       "the goodput in the progress line")
        assert session.snapshot().health["ledger"]["evaluation"] > 0  # eval_on_start took its share

    drive(session, scenario)


def test_the_notebook_status_line_carries_the_health_line():
    snapshot = SimpleNamespace(status="running", step=5, max_steps=10, epoch=None, samples_per_second=0.0,
                               tokens_per_second=None, eta=None, elapsed=1.0, run_name="r", device="cpu",
                               latest=lambda name: None, health={"ledger": LEDGER, "hang": HANG},
                               paused_seconds=0.0, training_seconds=1.0)
    html = status_html(snapshot)
    assert 'class="wb-health"' in html and "HANG: rank 1" in html and "color:#c00" in html
