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


def test_ctl_forks_a_headless_run_saves_a_variant_keeps_another_and_the_run_says_so(tmp_path):
    """The fork commands of ``workbench ctl`` against a headless run, as a shell user types them;
    the run's own output tells each one, and the saved variant resumes as a run of its own."""
    out = tmp_path / "out"
    with headless_run(tmp_path) as run:
        assert workbench("ctl", out, "pause", "--wait", cwd=tmp_path).returncode == 0
        step = ctl_status(out, tmp_path)["step"]
        forked = workbench("ctl", out, "fork", "5", "a:", "b: learning_rate=1e-3", cwd=tmp_path)
        assert forked.returncode == 0, forked.stderr
        assert forked.stdout.startswith(f"fork 1: 5 steps from step {step}") and "same batches" in forked.stdout
        saved = workbench("ctl", out, "save_variant", "b", "variant-b", cwd=tmp_path)
        assert saved.returncode == 0, saved.stderr
        path = tmp_path / "variant-b" / f"checkpoint-{step + 5}"
        assert saved.stdout.startswith(f"saved variant b: {path} ")
        kept = workbench("ctl", out, "keep", "a", "--reason", "the rate as it was", cwd=tmp_path)
        assert kept.returncode == 0 and kept.stdout.startswith(f"kept: fork 1: kept a after 5 steps from step {step}")
        assert ctl_status(out, tmp_path)["step"] == step + 5
        assert workbench("ctl", out, "stop", cwd=tmp_path).returncode == 0
        _, stderr = run.communicate(timeout=180)
        assert run.returncode == 0, stderr
    told = [line.removeprefix("workbench: ") for line in stderr.splitlines() if "from workbench ctl" in line]
    assert told[1].startswith(f"forked from workbench ctl at step {step}: a, b trained 5 steps each"), told
    assert told[2] == f"fork variant b saved to {path} from workbench ctl", told
    assert told[3].startswith(f"fork 1: kept a after 5 steps from step {step}") and told[3].endswith(
        f"; the rate as it was from workbench ctl; paused at step {step + 5}"), told
    # The saved variant, a run of its own: resumed in its folder, it trains on from its step.
    config = (tmp_path / "run.toml").read_text().replace("max_steps = 100000", f"max_steps = {step + 8}")
    (tmp_path / "b.toml").write_text(config.replace('output_dir = "out"', 'output_dir = "variant-b"'))
    resumed = workbench("run", "b.toml", "--headless", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from checkpoint-{step + 5}" in resumed.stderr
    assert f"finished at step {step + 8}" in resumed.stdout
    starts = [e for e in read_events(tmp_path / "variant-b") if e["event"] == "start"]
    assert len(starts) == 1, "the saved variant's own event log, begun by its resume"
