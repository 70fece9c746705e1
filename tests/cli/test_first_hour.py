"""The first hour of a new user at the command line (issue 29), through ``workbench``'s own
entry point: ``ctl --help`` lists every command, a model refusing its options is told at the
config line, a run shows it trains after its first step, and how a run ended reads the same
in the CLI, the dashboard's log, ``watch`` and ``ctl``."""

from __future__ import annotations

import pytest

from workbench.cli import main
from workbench.control.ctl_commands import CTL_COMMANDS
from workbench.control.outcome import describe_outcome
from workbench.door.endings import STOPPED_BY, describe_end
from workbench.widgets.view import describe_event

from support.configs import write

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


@pytest.mark.parametrize("reason", [*STOPPED_BY, None])
def test_how_a_run_ended_reads_the_same_everywhere(reason):
    """One wording (door/endings.py): the end record as ctl and attach tell it, the live
    event in the dashboard's log and watch's replay, and the CLI's own line."""
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
