"""The first hour of a new user at the command line (issue 29), through ``workbench``'s own
entry point: ``ctl --help`` lists every command, a model refusing its options is told at the
config line, a run shows it trains after its first step, how a run ended reads the same
in the CLI (headless, or quit from its dashboard), the dashboard's log, ``watch``, ``attach``
and ``ctl``, and ``watch`` into a pipe prints a live run in plain lines."""

from __future__ import annotations

import re
import threading

import pytest

from workbench.cli import main
from workbench.control.ctl_commands import CTL_COMMANDS
from workbench.control.outcome import describe_outcome
from workbench.door.values import Status
from workbench.door.endings import STOPPED_BY, describe_end
from workbench.widgets.view import describe_event

from support import DEADLINE, wait_until
from support.configs import write
from support.sessions import running

# A run of seconds: an MLP on random classes, logging every 25 of its 30 steps.
MLP_30 = """\
[model]
builtin = "mlp"
[model.options]
in_features = 8
num_classes = 3
[data]
builtin = "random-classification"
[data.options]
n_train = 32
n_eval = 8
in_features = 8
num_classes = 3
[training]
output_dir = "out"
max_steps = 30
logging_steps = 25
per_device_train_batch_size = 4
report_to = "none"
"""


def test_ctl_help_lists_every_command_with_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["ctl", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    listed = text.split("commands:\n", 1)[1].splitlines()
    for name in CTL_COMMANDS:
        assert sum(line.lstrip().startswith(f"{name} ") for line in listed) == 1, (name, text)
    assert "evaluate" in text and "--json" in text


def test_evaluate_and_a_misspelled_command_at_the_command_line(capsys, tmp_path):
    """No run is needed to be told a typo: the command is checked before connecting."""
    assert main(["ctl", str(tmp_path), "evalute"]) == 2
    assert "unknown command 'evalute' (did you mean evaluate?)" in capsys.readouterr().err
    assert main(["ctl", str(tmp_path), "evaluate"]) == 3  # a real command: then, no live run there
    assert "no live run" in capsys.readouterr().err


def test_a_model_shape_error_names_the_config_line(capsys, tmp_path):
    config = tmp_path / "shape.toml"
    assert main(["init", str(config)]) == 0
    text = config.read_text().replace("n_head = 4 ", "n_head = 3 ")
    config.write_text(text)
    capsys.readouterr()
    small = ["--set", "data.options.max_chars=20000"]
    assert main(["run", str(config), "--headless", *small]) == 2
    err = capsys.readouterr().err.strip()
    lines = text.splitlines()
    embd = next(i for i, line in enumerate(lines, 1) if line.startswith("n_embd"))
    head = next(i for i, line in enumerate(lines, 1) if line.startswith("n_head"))
    assert err == (f"workbench: {config}:{embd}: model.options.n_embd: n_embd (128) must be divisible by n_head (3) "
                   f"(model.options.n_head is on line {head})"), err
    assert not (tmp_path / "runs").exists()  # refused before anything was written
    # The same from the command line: the override is named.
    assert main(["run", str(config), "--headless", *small, "--set", "model.options.n_head=5"]) == 2
    assert "workbench: --set model.options.n_head=5: n_embd (128) must be divisible by n_head (5)" in \
        capsys.readouterr().err


def test_a_headless_run_says_it_trains_after_its_first_step(capsys, tmp_path):
    config = write(tmp_path, MLP_30)
    assert main(["run", str(config), "--headless"]) == 0
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("training: step 1/30 took "))
    assert out[first].endswith("s; a progress line every 25 steps"), out[first]
    assert first < next(i for i, line in enumerate(out) if line.startswith("step 25/30 |"))
    assert not [line for line in out if line.startswith("step 1/")]  # readers of "step N/M |" lines: unchanged


# A run that goes on until it is stopped (the MLP runs hundreds of steps a second), with no
# progress line before its end and an events.jsonl for watch, ctl and attach to read.
MLP_LONG = MLP_30.replace("max_steps = 30", "max_steps = 100000").replace("logging_steps = 25",
                                                                         "logging_steps = 100000")


def _long_config(tmp_path):
    """MLP_LONG with an absolute output_dir, which every front-end names as it is."""
    out = tmp_path / "out"
    text = MLP_LONG.replace('output_dir = "out"', f'output_dir = "{out}"').replace('"none"', '["jsonl"]')
    return write(tmp_path, text), out


def test_how_a_run_ended_reads_the_same_everywhere(capsys, tmp_path):
    """One wording (door/endings.py), read from each front-end's own output over one real run
    stopped with workbench ctl: the CLI's last line, ctl's line about the ended run, an
    attached client's end note, watch's plain summary and the event watch's log shows."""
    from workbench.control.client import attach
    from workbench.control.discovery import CONTROL_FILE
    from workbench.control.watch import RecordedRun

    config, out = _long_config(tmp_path)
    told: dict = {}

    def stop_from_ctl() -> None:  # what `workbench ctl OUT stop` does, from beside the run
        try:
            wait_until(lambda: (out / CONTROL_FILE).exists(), "the run's endpoint")
            remote = attach(out, client="ctl")
            wait_until(lambda: remote.snapshot().step >= 3, "a few steps")
            remote.stop()
            remote.wait(DEADLINE)
            told["attach"] = remote.end_note()  # what `workbench attach` prints once the run has ended
            remote.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            told["error"] = exc

    stopper = threading.Thread(target=stop_from_ctl, daemon=True)
    stopper.start()
    assert main(["run", str(config), "--headless"]) == 0
    stopper.join(DEADLINE)
    if "error" in told:
        raise told["error"]
    cli = capsys.readouterr().err.strip().splitlines()[-1]
    step = int(re.fullmatch(r"workbench: stopped from workbench ctl at step (\d+); checkpoint saved in (.+)",
                            cli).group(1))
    assert cli == f"workbench: stopped from workbench ctl at step {step}; checkpoint saved in {out}"
    assert (out / f"checkpoint-{step}").is_dir()
    words = f"stopped from workbench ctl at step {step}"

    assert main(["ctl", str(out), "status"]) == 3  # the run has ended: ctl says how
    ctl = capsys.readouterr().err.strip()
    assert ctl.endswith(f"; the run {words}, checkpoint saved (exit code 0)"), ctl
    assert told["attach"] == f"the run {words}, checkpoint saved (exit code 0)"
    assert main(["watch", str(out)]) == 0  # not a terminal: plain lines
    watched = capsys.readouterr().out.splitlines()
    assert watched[0].split(": ", 1)[1].startswith(f"{words}/100000 after "), watched
    finished = [e for e in RecordedRun(out).events_since(0)[0] if e.kind == "finished"]
    assert describe_event("finished", finished[-1].step, finished[-1].data) == (
        "warn", f"{words}, checkpoint saved (exit code 0)")


@pytest.mark.parametrize("reason", [*STOPPED_BY, None])
def test_every_stop_reason_is_worded_alike_by_ctl_and_the_dashboards_log(reason):
    """Each reason a stop can carry, as ctl / attach tell an end record and as the dashboard's
    log and watch's replay tell the live event: the same words, none of them internal jargon."""
    status = "stopped" if reason else "finished"
    record = {"status": status, "stop_reason": reason, "saved": True, "exit_code": 0, "step": 7}
    words = describe_end(status, reason, 7)
    assert describe_outcome(record) == f"the run {words} (exit code 0)"
    assert describe_event("finished", 7, {**record, "stopped": bool(reason)})[1] == f"{words} (exit code 0)"
    assert "session" not in words.replace("session.stop()", "")  # no internal jargon
    if reason == "ctl":
        assert words == "stopped from workbench ctl at step 7, checkpoint saved"
    if reason is None:
        assert words == "finished at step 7"


def test_the_cli_says_who_stopped_a_run_from_its_dashboard(capsys, tmp_path, monkeypatch):
    """``workbench run`` on a terminal, quit with q then enter in its dashboard (driven with
    Pilot): the CLI's last line says the dashboard stopped it, at which step, and where the
    checkpoint is, in door/endings.py's words."""
    import asyncio
    import sys

    from workbench.widgets import tui
    from workbench.widgets.tui.app import DashboardApp
    from workbench.widgets.tui.dialogs import QuitDialog

    from support.dashboard import press, wait_for

    def piloted(session, **options) -> str:  # run_dashboard, with Pilot's keys instead of a person's
        app = DashboardApp(session)

        async def quit_and_save() -> None:
            async with app.run_test(size=(100, 32)) as pilot:
                await wait_for(pilot, lambda: session.snapshot().step >= 3, "a few steps")
                await press(pilot, "q")
                await wait_for(pilot, lambda: isinstance(app.screen, QuitDialog) and app.screen.focused, "the dialog")
                await press(pilot, "enter")  # stop and save
                await wait_for(pilot, lambda: app.return_value is not None, "the app to exit")

        asyncio.run(quit_and_save())
        return app.return_value

    monkeypatch.setattr(tui, "run_dashboard", piloted)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # the dashboard path of `workbench run`
    config, out = _long_config(tmp_path)
    assert main(["run", str(config)]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.fullmatch(r"workbench: stopped from the dashboard at step (\d+); checkpoint saved in (.+)", last)
    assert found and found.group(2) == str(out), last
    assert (out / f"checkpoint-{found.group(1)}").is_dir()


def test_watch_piped_prints_a_live_run_in_plain_lines(capsys, tmp_path, sessions):
    """``workbench watch OUT | cat`` on a run still training: where it is and how to follow or
    steer it, without escape codes, and the run goes on untouched."""
    out = tmp_path / "run"
    session = running(out, sessions)
    assert main(["watch", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "\x1b" not in "\n".join(lines)
    assert lines[0].split(": ", 1)[1].startswith("running at step "), lines
    assert lines[1].startswith("step ") and " · elapsed " in lines[1], lines
    assert lines[-1] == (f"live: workbench watch {out} on a terminal follows it; workbench attach / ctl "
                         "steer it"), lines
    assert session.status == Status.RUNNING and session.stop_reason is None  # watched, not steered


def test_a_second_ctrl_c_is_told_in_the_words_of_every_ending(capsys, tmp_path, monkeypatch):
    """A second Ctrl-C ends ``workbench run`` without waiting for the save the first one asked
    for: its last line says so as every other ending does (door/endings.py), exit code 130."""
    from workbench.core.exit_codes import EXIT_INTERRUPTED
    from workbench.session.local import Session

    def interrupted(self):  # what the signal handler raises at the second press (cli/train.py abort)
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "run", interrupted)
    config, out = _long_config(tmp_path)
    assert main(["run", str(config), "--headless"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == "workbench: stopped by Ctrl-C at step 0 without saving"
    assert not list(out.glob("checkpoint-*"))
