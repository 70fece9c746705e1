"""``workbench ctl OUTDIR set "schedule=..."`` (issue 28) against a real headless run, as the
README shows it: a refusal in one line with exit status 2, then a cooldown applied while
paused, recorded with its reason in events.jsonl, and the run ending where it says."""

from __future__ import annotations

from workbench.core.event_file import read_events

from support import workbench
from support.headless import ctl_status, headless_run


def test_ctl_sets_a_schedule_change_on_a_headless_run(tmp_path):
    out = tmp_path / "out"
    with headless_run(tmp_path) as run:
        paused = workbench("ctl", out, "pause", "--wait", cwd=tmp_path)
        assert paused.returncode == 0, paused.stderr
        status = ctl_status(out, tmp_path)
        step, before = status["step"], status["max_steps"]
        bad = workbench("ctl", out, "set", "schedule=decay_now steps=0", cwd=tmp_path)
        assert bad.returncode == 2 and "whole number >= 1" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
        assert ctl_status(out, tmp_path)["max_steps"] == before  # refused: nothing changed
        edited = workbench("ctl", out, "set", "schedule=decay_now steps=20 to=min_lr", "--reason", "cool down",
                           cwd=tmp_path)
        assert edited.returncode == 0, edited.stderr
        assert edited.stdout.startswith("applied: schedule") and "decay_now" in edited.stdout, edited.stdout
        assert ctl_status(out, tmp_path)["max_steps"] == step + 20  # the run now ends with the cooldown
        resumed = workbench("ctl", out, "resume", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        _, stderr = run.communicate(timeout=180)
        assert run.returncode == 0, stderr
    events = read_events(out)
    edits = [e for e in events if e["event"] == "edit"]
    assert len(edits) == 1 and edits[0]["reason"] == "cool down"
    change = edits[0]["schedule"]
    assert (change["op"], change["steps"], change["to"], change["at"]) == ("decay_now", 20, "min_lr", step)
    # The rate logged after the change is the cooldown's: falling, and nothing trained past it.
    rates = [(e["step"], e["learning_rate"]) for e in events if e["event"] == "log" and "learning_rate" in e]
    after = [rate for s, rate in rates if s > step]
    assert len(after) == 2 and after[0] > after[1] and max(s for s, _ in rates) <= step + 20  # (every 10 steps)
    assert [e["step"] for e in events if e["event"] == "end"] == [step + 20]
