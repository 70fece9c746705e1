"""Scripts written like transformers' examples run unchanged on workbench (issue 23).

Each script in ``examples/hf_scripts/`` (causal LM on local text, masked LM with random
masking, sentence classification on csv files with predict) parses its arguments with
``HfArgumentParser``, loads local files through ``datasets``, a tokenizer trained here and a
model saved with ``save_pretrained``, and ends with ``log_metrics`` / ``save_metrics`` /
``save_state`` / ``create_model_card``. Each runs twice in a subprocess: as written (workbench's
Trainer) and with only its ``Trainer, TrainingArguments`` import switched to transformers'.
Both must exit 0, log the same losses, learning rates and evaluation numbers, write the same
result files, and resume.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

transformers = pytest.importorskip("transformers", reason="the scripts are transformers scripts (test extra)")
pytest.importorskip("tokenizers", reason="the assets train a tokenizer locally")


SCRIPTS = REPO / "examples" / "hf_scripts"
IMPORT = "from workbench import Trainer, TrainingArguments"
COMMON = ["--do_train", "--do_eval", "--max_steps", "12", "--logging_steps", "1", "--eval_strategy", "steps",
          "--eval_steps", "6", "--save_steps", "6", "--per_device_train_batch_size", "4",
          "--per_device_eval_batch_size", "16", "--report_to", "none", "--disable_tqdm", "true", "--seed", "42"]
BLOCK = 32  # run_clm.py's default block_size
RESULT_FILES = ("all_results.json", "train_results.json", "eval_results.json", "trainer_state.json", "README.md")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("assets")
    subprocess.run([sys.executable, str(SCRIPTS / "make_assets.py"), str(out)], check=True, capture_output=True,
                   timeout=600)
    return out


def script_args(name: str, assets: Path) -> list[str]:
    if name == "run_clm":
        return ["--model_name_or_path", str(assets / "gpt2"), "--train_file", str(assets / "text/train.txt"),
                "--validation_file", str(assets / "text/validation.txt"), "--max_eval_samples", "40"]
    if name == "run_mlm":
        return ["--model_name_or_path", str(assets / "bert-mlm"), "--train_file", str(assets / "text/train.txt"),
                "--validation_file", str(assets / "text/validation.txt"), "--max_eval_samples", "40"]
    return ["--model_name_or_path", str(assets / "bert-cls"), "--train_file", str(assets / "cls/train.csv"),
            "--validation_file", str(assets / "cls/validation.csv"), "--test_file", str(assets / "cls/test.csv"),
            "--do_predict"]


def run_script(name: str, flavour: str, out: Path, assets: Path, extra: list[str] = ()) -> subprocess.CompletedProcess:
    """Run ``examples/hf_scripts/<name>.py`` as written ("workbench") or with only its Trainer
    import switched to transformers' ("transformers")."""
    source = (SCRIPTS / f"{name}.py").read_text(encoding="utf-8")
    assert source.count(IMPORT) == 1
    if flavour == "transformers":
        source = source.replace(IMPORT, "from transformers import Trainer, TrainingArguments")
    script = out.parent / f"{flavour}_{name}.py"
    script.write_text(source, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "WORKBENCH_CONTROL": "0", "HF_DATASETS_CACHE": str(out.parent / "ds-cache")}
    argv = [sys.executable, str(script), *script_args(name, assets), *COMMON, "--output_dir", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=out.parent)


def history(out: Path) -> list[dict]:
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def steps_of(log: list[dict], key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in log if key in entry}


@pytest.mark.parametrize("name", ["run_clm", "run_mlm", "run_classification"])
def test_script_runs_unchanged_with_the_same_numbers(name, assets, tmp_path):
    runs = {}
    for flavour in ("transformers", "workbench"):
        out = tmp_path / flavour / "out"
        out.parent.mkdir()
        done = run_script(name, flavour, out, assets)
        assert done.returncode == 0, f"{flavour} {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        runs[flavour] = out
    hf, wb = (history(runs[f]) for f in ("transformers", "workbench"))

    # Every step's loss and learning rate, and every evaluation, as transformers logs them.
    # The causal LM is the documented exception (README, "Differences from the HF Trainer"):
    # transformers 5.x divides GPT-2's summed loss by every label of the block (it counts
    # shifted targets only for class names with "ForCausalLM"), workbench by the targets the
    # model is trained on, one fewer per row: HF's loss and gradient are (L-1)/L of workbench's.
    # (Evaluation too: HF passes its count to the model there as well.)
    scale = (BLOCK - 1) / BLOCK if name == "run_clm" else 1.0
    for key in ("loss", "eval_loss"):
        if scale == 1.0:
            assert steps_of(wb, key) == steps_of(hf, key), key
        else:
            assert steps_of(hf, key) == pytest.approx({s: v * scale for s, v in steps_of(wb, key).items()},
                                                      rel=1e-6), key
    for key in ("learning_rate", "eval_accuracy", "epoch"):
        assert steps_of(wb, key) == steps_of(hf, key), key
    assert steps_of(hf, "grad_norm") == pytest.approx(
        {s: v * scale for s, v in steps_of(wb, "grad_norm").items()}, rel=1e-5)

    for file in RESULT_FILES + (("predict_results.txt",) if name == "run_classification" else ()):
        assert (runs["workbench"] / file).is_file(), file
        assert (runs["transformers"] / file).is_file(), file
    for file in ("all_results.json", "train_results.json", "eval_results.json"):
        hf_res, wb_res = (json.loads((runs[f] / file).read_text()) for f in ("transformers", "workbench"))
        assert set(wb_res) == set(hf_res), file
        for key in ("eval_accuracy", "train_samples", "eval_samples", "epoch"):
            if key in hf_res:
                assert wb_res[key] == hf_res[key], (file, key)
        if "eval_loss" in hf_res:
            assert hf_res["eval_loss"] == pytest.approx(wb_res["eval_loss"] * scale, rel=1e-6), file
            if scale == 1.0:
                assert (wb_res["eval_loss"], wb_res.get("perplexity")) == (hf_res["eval_loss"], hf_res.get("perplexity"))
        if "train_loss" in hf_res:
            assert hf_res["train_loss"] == pytest.approx(wb_res["train_loss"] * scale, rel=1e-6), file
    if name == "run_classification":
        assert ((runs["workbench"] / "predict_results.txt").read_text()
                == (runs["transformers"] / "predict_results.txt").read_text())
    card = (runs["workbench"] / "README.md").read_text()
    assert "learning_rate" in card and "Training results" in card

    # Resume: from the step-6 checkpoint of a copy, the same losses as the uninterrupted run.
    resumed = tmp_path / "resumed" / "out"
    resumed.parent.mkdir()
    resumed.mkdir()
    import shutil

    shutil.copytree(runs["workbench"] / "checkpoint-6", resumed / "checkpoint-6")
    done = run_script(name, "workbench", resumed, assets)  # the script finds checkpoint-6 itself
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = history(resumed)
    assert {s: v for s, v in steps_of(again, "loss").items() if s > 6} == {
        s: v for s, v in steps_of(wb, "loss").items() if s > 6}
    assert steps_of(again, "eval_loss")[12] == steps_of(wb, "eval_loss")[12]


def test_scripts_read_arguments_from_a_json_file(assets, tmp_path):
    """The scripts' ``script.py args.json`` form, through HfArgumentParser.parse_json_file."""
    args = {"model_name_or_path": str(assets / "bert-cls"), "train_file": str(assets / "cls/train.csv"),
            "validation_file": str(assets / "cls/validation.csv"), "output_dir": str(tmp_path / "out"),
            "do_train": True, "do_eval": True, "max_steps": 3, "logging_steps": 1, "report_to": "none",
            "disable_tqdm": True, "lr_scheduler_type": "cosine", "warmup_steps": 0.1,
            "lr_scheduler_kwargs": {}, "save_strategy": "no"}
    config = tmp_path / "args.json"
    config.write_text(json.dumps(args))
    source = (SCRIPTS / "run_classification.py").read_text(encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WORKBENCH_CONTROL": "0",
           "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds-cache")}
    script = tmp_path / "run.py"
    script.write_text(source, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"train_loss\s+=", done.stdout)
    assert len(steps_of(history(tmp_path / "out"), "loss")) == 3
