"""``workbench ctl OUTDIR fork | keep | save_variant | discard`` (issue 28): A/B forks from a
shell, as a person or an agent steering with ctl types them (run_ctl in this process, the run
in a Session): the report printed as the fork screen's table, a variant saved and one kept,
every mistake one line with exit status 2 and nothing changed."""

from __future__ import annotations

import json

from workbench.control.ctl import run_ctl

from support import DEADLINE, finish
from support.sessions import running


def printed(capsys) -> list[str]:
    """What ctl printed: the run trains in this process, and its console prints its logs too."""
    return [line for line in capsys.readouterr().out.splitlines() if not line.startswith("{'")]


def test_ctl_forks_a_paused_run_saves_one_variant_and_keeps_another(tmp_path, sessions, capsys):
    out = tmp_path / "run"
    session = running(out, sessions)
    capsys.readouterr()
    assert run_ctl(str(out), "fork", ["3", "a:", "b: learning_rate=1e-3"]) == 2  # running: refused, nothing forks
    assert "ctl fork: fork: pause the run first" in capsys.readouterr().err
    session.pause(wait=True, timeout=DEADLINE)
    step = session.snapshot().step

    assert run_ctl(str(out), "fork", ["3", "a:", "b: learning_rate=1e-3"]) == 0
    lines = printed(capsys)
    assert lines[0].startswith(f"fork 1: 3 steps from step {step}, ") and lines[0].endswith("(keep one or discard)")
    assert lines[1].split() == ["variant", "changes", "train", "loss", "eval_loss", "same", "batches"]
    assert lines[2].startswith(f"parent at step {step}")
    assert lines[3].split()[:2] == ["a", "(unchanged)"] and lines[3].endswith("yes")
    assert lines[4].split()[:2] == ["b", "learning_rate=0.001"] and lines[4].endswith("yes")
    assert lines[5] == f"then: workbench ctl {out} keep NAME | save_variant NAME [FOLDER] | discard"

    assert run_ctl(str(out), "save-variant", ["b", str(tmp_path / "b")], reason="for later") == 0
    path = tmp_path / "b" / f"checkpoint-{step + 3}"
    assert printed(capsys)[0].startswith(f"saved variant b: {path} (the fork stays open")
    assert (path / "trainer_state.json").is_file() and session.snapshot().step == step

    assert run_ctl(str(out), "keep", ["a"], reason="the rate as it was", as_json=True) == 0
    kept = json.loads(printed(capsys)[0])
    assert kept["fork"]["kept"] == "a" and kept["reason"].endswith("; the rate as it was")
    assert session.snapshot().step == step + 3 and session.snapshot().fork["state"] == "kept"

    # One line each, exit code 2, nothing changed: malformed commands and the run's refusals.
    for args, said in [(("fork", ["x", "a:"]), "ctl fork: usage: fork STEPS NAME:"),
                       (("fork", ["3"]), "ctl fork: usage: fork STEPS NAME:"),
                       (("fork", ["3", "b learning_rate=1"]), "ctl fork: fork: expected NAME: KEY=VALUE"),
                       (("keep", []), "ctl keep: usage: keep NAME"),
                       (("keep", ["b"]), "ctl keep: keep: no fork whose variants are held"),
                       (("save_variant", ["a", "x", "y"]), "ctl save_variant: usage: save_variant NAME [FOLDER]"),
                       (("discard", ["a"]), "ctl discard: takes no arguments")]:
        assert run_ctl(str(out), *args) == 2, args
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err, (args, err)
    assert session.snapshot().step == step + 3 and len(session.snapshot().edits) == 1

    assert run_ctl(str(out), "fork", ["2", "c: learning_rate=5e-2"]) == 0
    capsys.readouterr()
    assert run_ctl(str(out), "discard", []) == 0
    assert printed(capsys)[0].startswith("discarded: the run goes on from the pause unchanged")
    assert session.snapshot().fork["state"] == "discarded" and session.snapshot().step == step + 3
    session.stop(save=False)
    finish(session)
