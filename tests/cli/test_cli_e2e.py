"""The ``workbench`` command end to end, as a user types it: init, run from another folder,
the refusal to clobber checkpoints, --resume, --overwrite, the checkpoints table, one-line
usage errors with their file and line, a failing factory model's exit code and error event,
and the embedded demo run to its end.
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.core.event_file import read_events

from support import REPO, checkpoint_steps, outcome, start_workbench, workbench

TINY_STARTER = [  # make the starter config's run a few seconds on a CPU
    "--set", "training.max_steps=5", "--set", "training.logging_steps=2", "--set", "training.eval_steps=5",
    "--set", "training.save_steps=5", "--set", "model.options.n_embd=32", "--set", "model.options.n_head=2",
    "--set", "model.options.n_layer=1", "--set", "model.options.block_size=32",
    "--set", "data.options.block_size=32", "--set", "data.options.max_chars=20000",
    "--set", "training.per_device_train_batch_size=4", "--set", "training.per_device_eval_batch_size=16",
]


def assert_one_line_usage_error(result: tuple[int, str, str]) -> str:
    code, _, stderr = result
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_cli_init_run_refuse_resume_overwrite_checkpoints(tmp_path):
    config = tmp_path / "cfg.toml"
    init = workbench("init", config, cwd=tmp_path)
    assert init.returncode == 0 and config.is_file()
    assert "[model]" in config.read_text() and "[training]" in config.read_text()
    assert workbench("init", config, cwd=tmp_path).returncode == 2  # never clobbers

    # Run from another folder: relative paths resolve against the config's folder.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = workbench("run", config, "--headless", *TINY_STARTER, cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "runs" / "cfg"  # the starter's output_dir follows the config's name
    lines = run.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert progress, run.stdout
    # logging every 2 steps: 2 and 4 print; the last step (5) is no logging step (HF).
    assert "step 2/5" in progress[0] and "step 4/5" in progress[-1]
    for part in ("loss ", "lr ", "samples/s", "ETA"):
        assert all(part in line for line in progress), (part, progress)
    assert any(line.startswith("eval @ step 0:") and "eval_loss" in line for line in lines)
    assert any(line.startswith("eval @ step 5:") for line in lines)
    assert checkpoint_steps(out) == [5]

    resolved = (out / "config.toml").read_text()
    import tomllib

    raw = tomllib.loads(resolved)
    assert Path(raw["training"]["output_dir"]).is_absolute()
    assert Path(raw["training"]["output_dir"]) == out
    assert raw["training"]["max_steps"] == 5  # overrides are recorded

    events = read_events(out)
    assert events[0]["event"] == "start" and events[-1]["event"] == "end" and events[-1]["step"] == 5
    first_eval = [e for e in events if e["event"] == "eval"][0]
    assert first_eval["step"] == 0

    # A second plain run refuses to clobber the checkpoints; `checkpoints` lists them meanwhile.
    refuse = start_workbench("run", config, "--headless", *TINY_STARTER, cwd=tmp_path)
    table = start_workbench("checkpoints", out, cwd=tmp_path)
    as_json = start_workbench("checkpoints", out, "--json", cwd=tmp_path)
    line = assert_one_line_usage_error(outcome(refuse))
    assert "--resume" in line and "--overwrite" in line
    assert checkpoint_steps(out) == [5]

    code, stdout, stderr = outcome(table)
    assert code == 0, stderr
    assert "checkpoint-5" in stdout and "verified" in stdout and "eval_loss=" in stdout  # hashes checked
    code, stdout, stderr = outcome(as_json)
    assert code == 0, stderr
    rows = json.loads(stdout)
    assert [r["name"] for r in rows] == ["checkpoint-5"]
    assert rows[0]["step"] == 5 and rows[0]["complete"] is True and rows[0]["verified"] is True
    assert "eval_loss" in rows[0]["metrics"]

    # --resume continues from checkpoint-5 to a larger max_steps.
    resume = workbench("run", config, "--headless", "--resume", *TINY_STARTER, "--set", "training.max_steps=8",
                 cwd=tmp_path)
    assert resume.returncode == 0, resume.stderr
    assert "step 6/8" in resume.stdout and "step 2/8" not in resume.stdout
    assert checkpoint_steps(out) == [5, 8]
    events = read_events(out)
    starts = [e for e in events if e["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 5]
    assert events[-1]["event"] == "end" and events[-1]["step"] == 8

    # --overwrite starts over: old checkpoints and events are gone.
    over = workbench("run", config, "--headless", "--overwrite", *TINY_STARTER, "--set", "training.max_steps=3",
               "--set", "training.save_steps=3", cwd=tmp_path)
    assert over.returncode == 0, over.stderr
    assert "step 2/3" in over.stdout
    assert checkpoint_steps(out) == [3]
    events = read_events(out)
    assert [e["step"] for e in events if e["event"] == "start"] == [0]
    assert events[-1]["event"] == "end" and events[-1]["step"] == 3


MLP_CONFIG = """\
run_name = "mlp"
[model]
{model}
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
max_steps = 4
per_device_train_batch_size = 4
learnig_rate = 1e-3
"""

FAILING_FACTORY = '''\
from workbench.models import MLPClassifier


class Exploding(MLPClassifier):
    def forward(self, x, labels=None, **kwargs):
        raise RuntimeError("factory model forward failed on purpose")


def build(in_features, num_classes):
    return Exploding(in_features=in_features, num_classes=num_classes)
'''


def test_cli_errors_and_failure_exit_codes(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(MLP_CONFIG.format(model='builtin = "mlp"'))
    good = tmp_path / "good.toml"
    good.write_text(MLP_CONFIG.format(model='builtin = "mlp"').replace("learnig_rate", "learning_rate"))
    failing = tmp_path / "failing.toml"
    failing.write_text(MLP_CONFIG.format(model='factory = "explode:build"')
                       .replace("learnig_rate", "learning_rate").replace('"out"', '"failing-out"'))
    (tmp_path / "explode.py").write_text(FAILING_FACTORY)

    # Started together: each pays the interpreter and torch start-up, so overlap them.
    unknown = start_workbench("run", bad, "--headless", cwd=tmp_path)
    typo = start_workbench("run", good, "--headless", "--set", "training.learnig_rate=1", cwd=tmp_path)
    fail = start_workbench("run", failing, "--headless", cwd=tmp_path)
    missing = workbench("run", tmp_path / "nope.toml", "--headless", cwd=tmp_path)

    line = assert_one_line_usage_error((missing.returncode, missing.stdout, missing.stderr))
    assert "nope.toml" in line

    line = assert_one_line_usage_error(outcome(unknown))
    assert f"{bad}:18:" in line  # file:line of the misspelled key
    assert "training.learnig_rate" in line and "did you mean learning_rate" in line
    assert not (tmp_path / "out").exists()  # rejected before any work

    line = assert_one_line_usage_error(outcome(typo))
    assert "--set" in line and "learnig_rate" in line and "did you mean learning_rate" in line

    code, stdout, stderr = outcome(fail)
    assert code == 1, stderr
    assert "Traceback" in stderr and "factory model forward failed on purpose" in stderr
    events = read_events(tmp_path / "failing-out")
    errors = [e for e in events if e["event"] == "error"]
    assert len(errors) == 1
    assert "factory model forward failed on purpose" in errors[0]["error"]
    assert "Traceback" in errors[0]["traceback"]
    assert not any(e["event"] == "end" for e in events)


# -- 11. the embedded demo, end to end ---------------------------------------------------------------


def test_tiny_gpt_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = workbench("run", REPO / "examples" / "tiny-gpt.toml", "--headless", "--set", f"training.output_dir={out}",
                 cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [e for e in read_events(out) if e["event"] == "eval"]
    assert evals[0]["step"] == 0  # eval_on_start
    assert evals[-1]["step"] == 300
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0, (evals[0]["eval_loss"], evals[-1]["eval_loss"])
    assert "eval_accuracy" in evals[-1] and "eval_perplexity" in evals[-1]
    assert checkpoint_steps(out) == [200, 300]  # save_total_limit = 2
